//! `rak-train`: the trainer behind `host train` (and command plugins such as `aar-train`):
//! a run's life cycle from recipe to final model (`run`, `recipe`), multitask samplers, contrastive losses, learning-rate schedules, BM25 and ANCE hard
//! negatives, checkpoints and exact resume, and the task-specialisation analysis behind
//! `host analyze`.
//!
//! It builds on `rak-core` (encoders and optimizers through the plugin traits) and
//! `rak-retrieval` (BM25, encoding and exact search for hard negatives). It loads no plugins
//! itself: the host hands it trait objects.

pub mod analyze;
pub mod data;
pub mod loss;
pub mod negatives;
pub mod recipe;
pub mod run;
pub mod sampler;
pub mod schedule;
pub mod trainer;
