//! `rak-retrieval`: the retrieval pipeline's library, behind `host encode | index | search |
//! eval`.
//!
//! - [`aligned`]: `f32` storage on cache-line boundaries, what the indexes score.
//! - [`data`]: data sets and runs: BEIR, KILT, DPR, MS MARCO, TREC runs, mini-KILT.
//! - [`digest`]: SHA-256 of file contents, what caches and resumable outputs are keyed on.
//! - [`eval`]: retrieval metrics (trec_eval measures, KILT page R-precision, DPR answer accuracy).
//! - [`index`]: exact inner product, HNSW maximum inner product, BM25 (tantivy).
//! - [`npy`]: `.npy` float32 matrices and `ids.txt`, the embedding files.
//! - [`pipeline`]: encode, index, search and evaluate as library functions (what the CLI, the
//!   host's services for command plugins and the trainer call).
//!
//! Plugins do not need it: it is kept apart from `rak-core` so that a plugin builds against
//! the ABI and the models only.

pub mod aligned;
pub mod data;
pub mod digest;
pub mod eval;
pub mod index;
pub mod npy;
pub mod pipeline;
