//! Transformer models in tch with Hugging Face parameter names, one file per architecture
//! (the config struct beside the model), plus checkpoint and tokenizer I/O.

pub mod bert;
pub mod dropout;
pub mod onednn;
pub mod pooling;
pub mod t5;
pub mod tokenizer;
pub mod weights;
