pub mod identity;

mod test_macros;
mod test_utils;
