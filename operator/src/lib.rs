//! Ferry's operator, being built. So far: the CustomResourceDefinitions (generated from the
//! Rust types in `ferry-api`, feature `crd`, and written to `crds/` by `crdgen`) and the pure
//! build step that turns a group of rules into its forwarder config (`render`).

pub mod children;
pub mod controller;
pub mod crdgen;
pub mod render;
pub mod validate;
