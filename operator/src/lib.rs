//! Ferry's operator. So far: the CustomResourceDefinitions, generated from the Rust types in
//! `ferry-api` (feature `crd`) and written to `crds/` by `crdgen`.

pub mod crdgen;
