//! Ready-made [`Reader`](crate::plugin::Reader) implementations the built-in reader plugins
//! wrap (`fid` over T5), kept in core so third parties can reuse them.

pub mod fid;
