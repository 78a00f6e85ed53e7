//! Ferry's operator: reconciles BrokerConnections and ForwardingRules (their CRDs generated
//! from the Rust types in `ferry-api`, feature `crd`) into one forwarder StatefulSet per group,
//! and reports each rule's state from the forwarder pods' `/status`.

pub mod apply;
pub mod budget;
pub mod children;
pub mod conditions;
pub mod context;
pub mod controller;
pub mod crdgen;
pub mod dataplane;
pub mod events;
pub mod finalize;
pub mod handover;
pub mod image;
pub mod metrics;
pub mod netpol;
pub mod ownership;
pub mod plan;
pub mod podstatus;
pub mod preflight;
pub mod readiness;
pub mod release;
pub mod render;
pub mod scope;
pub mod sessions;
pub mod status;
pub mod validate;
pub mod valuesdoc;
pub mod writer;
