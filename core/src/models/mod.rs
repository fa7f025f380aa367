//! Transformer models in tch with Hugging Face parameter names, one file per architecture
//! (the config struct beside the model), plus checkpoint and tokenizer I/O.

pub mod t5;
pub mod weights;
