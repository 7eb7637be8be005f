mod activation;
mod backward;
mod base;
mod bool_tensor;
mod int_tensor;
mod module;
mod qtensor;
mod tensor;
mod transaction;

pub(crate) mod maxmin;
pub(crate) mod sort;

pub use backward::*;
pub use base::*;
