//! Helpers shared by the integration tests of `kiln` and `kiln-cli` (a dev-dependency of both; not
//! published): `common` (assets, tiny models, free ports, the reference Python) and `fake_hub` (a
//! local stand-in for the Hugging Face Hub).

pub mod common;
pub mod fake_hub;
