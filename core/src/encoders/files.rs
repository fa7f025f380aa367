//! The files of a model folder the encoders read, or that a save writes or copies beside the
//! weights: one list for the encoders' saves here, the checkpoint adoption of `rak-retrieval`
//! (a save's own files, not the user's) and, checked equal by `tests/hub.rs`, what `rak-hub`
//! downloads (it does not link libtorch, so it keeps a copy).

/// Every model has these (besides its weights).
pub const REQUIRED: &[&str] = &["config.json", "tokenizer.json"];
/// The weights, one file (a save never shards them; the Hub's shard index is `rak-hub`'s).
pub const WEIGHTS: &str = "model.safetensors";
/// The toolkit's own encoder settings (pooling, lengths, towers).
pub const SETTINGS: &str = "rak_encoder.json";
/// A sentence-transformers checkpoint's settings at the top (6.x keeps max_seq_length in
/// `tokenizer_config.json`); its module folders come on top, as `modules.json` lists them.
pub const SENTENCE_TRANSFORMERS: &[&str] =
    &["modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"];
/// What a T5 save copies beside its own `tokenizer.json`.
pub const T5: &[&str] = &["tokenizer_config.json", "special_tokens_map.json", "spiece.model", "generation_config.json"];

/// The files a model has when it has them: [`SENTENCE_TRANSFORMERS`], [`T5`] and [`SETTINGS`],
/// each once.
pub fn optional() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for f in SENTENCE_TRANSFORMERS.iter().chain(T5).chain([&SETTINGS]) {
        if !out.contains(f) {
            out.push(f);
        }
    }
    out
}

/// Whether `name` (relative to the model folder) is one of the files above.
pub fn is_model_file(name: &str) -> bool {
    REQUIRED.contains(&name) || name == WEIGHTS || name == SETTINGS || SENTENCE_TRANSFORMERS.contains(&name) || T5.contains(&name)
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_file_is_named_once() {
        let all = super::optional();
        assert_eq!(all.len(), 9, "{all:?}");
        assert!(super::is_model_file("model.safetensors") && super::is_model_file("spiece.model") && !super::is_model_file("notes.txt"));
    }
}
