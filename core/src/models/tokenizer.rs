//! `tokenizer.json` (Hugging Face fast tokenizers) through the `tokenizers` crate, producing
//! padded id/mask tensors. Truncation and padding are set here, per call site, not taken from
//! whatever the file happened to be saved with.

use anyhow::{anyhow, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{Device, Tensor};
use tokenizers::{
    EncodeInput, PaddingDirection, PaddingParams, PaddingStrategy, Tokenizer, TruncationDirection, TruncationParams,
    TruncationStrategy,
};

/// How to pad a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Padding {
    /// To the longest sequence in the batch.
    Longest,
    /// To exactly this length.
    Fixed(usize),
    /// Not at all (one sequence per call).
    None,
}

/// One row of a batch to tokenise: a text, or a `(first, second)` pair (BERT's
/// `[CLS] first [SEP] second [SEP]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextInput<'a> {
    Single(&'a str),
    Pair(&'a str, &'a str),
}

/// A batch of token ids, CPU tensors `[batch, length]` (int64).
pub struct Encoded {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub token_type_ids: Tensor,
}

impl Encoded {
    pub fn to_device(&self, device: Device) -> Encoded {
        Encoded {
            input_ids: super::upload(&self.input_ids, device),
            attention_mask: super::upload(&self.attention_mask, device),
            token_type_ids: super::upload(&self.token_type_ids, device),
        }
    }
}

/// A loaded tokenizer plus where it came from (for messages).
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    pad_id: u32,
    pad_token: String,
    /// Copies of `inner` set for one (max length, padding), made once: a copy holds the
    /// whole vocabulary, and making one per call cost 3.8 ms, more than encoding a short
    /// query (what a server asks one at a time).
    configured: Mutex<Vec<((usize, Padding), Arc<Tokenizer>)>>,
}

impl TextTokenizer {
    /// Load `dir/tokenizer.json` (or a file path).
    pub fn load(path: &Path) -> Result<Self> {
        let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
        if !file.exists() {
            anyhow::bail!("{}: missing tokenizer (no tokenizer.json)", file.display());
        }
        let mut inner = Tokenizer::from_file(&file).map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", file.display()))?;
        let (pad_id, pad_token) = match inner.get_padding() {
            Some(p) => (p.pad_id, p.pad_token.clone()),
            None => ["[PAD]", "<pad>", "<|pad|>"]
                .iter()
                .find_map(|t| inner.token_to_id(t).map(|id| (id, t.to_string())))
                .unwrap_or((0, "[PAD]".into())),
        };
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| anyhow!("{e}"))?;
        Ok(TextTokenizer { inner, path: file, pad_id, pad_token, configured: Mutex::new(Vec::new()) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Tokenise texts (or `(first, second)` pairs when `pairs` is given), truncating each to
    /// `max_length` tokens including special tokens, padded as asked.
    pub fn encode(&self, texts: &[&str], pairs: Option<&[&str]>, max_length: usize, padding: Padding) -> Result<Encoded> {
        let inputs: Vec<TextInput> = match pairs {
            Some(second) => texts.iter().zip(second).map(|(a, b)| TextInput::Pair(a, b)).collect(),
            None => texts.iter().map(|t| TextInput::Single(t)).collect(),
        };
        self.encode_inputs(&inputs, max_length, padding)
    }

    /// Tokenise a batch that may mix single texts and pairs, each row exactly as it would be
    /// tokenised alone (only padding depends on the batch), truncating each to `max_length`
    /// tokens including special tokens.
    pub fn encode_inputs(&self, inputs: &[TextInput], max_length: usize, padding: Padding) -> Result<Encoded> {
        let tok = self.configured(max_length, padding)?;
        let inputs: Vec<EncodeInput> = inputs
            .iter()
            .map(|i| match *i {
                TextInput::Single(t) => EncodeInput::Single(t.into()),
                TextInput::Pair(a, b) => EncodeInput::Dual(a.into(), b.into()),
            })
            .collect();
        let encodings = tok.encode_batch(inputs, true).map_err(|e| anyhow!("{}: {e}", self.path.display()))?;
        let rows = encodings.len() as i64;
        let len = encodings.iter().map(|e| e.len()).max().unwrap_or(0);
        anyhow::ensure!(
            padding != Padding::None || rows <= 1 || encodings.iter().all(|e| e.len() == len),
            "unpadded encoding of several texts of different lengths"
        );
        let flat = |f: &dyn Fn(&tokenizers::Encoding) -> &[u32]| -> Tensor {
            let v: Vec<i64> = encodings.iter().flat_map(|e| f(e).iter().map(|&x| x as i64)).collect();
            Tensor::from_slice(&v).view([rows, len as i64])
        };
        Ok(Encoded {
            input_ids: flat(&|e| e.get_ids()),
            attention_mask: flat(&|e| e.get_attention_mask()),
            token_type_ids: flat(&|e| e.get_type_ids()),
        })
    }

    /// The tokenizer with this call's truncation and padding (a copy made at first use).
    fn configured(&self, max_length: usize, padding: Padding) -> Result<Arc<Tokenizer>> {
        let key = (max_length, padding);
        let mut made = self.configured.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, tok)) = made.iter().find(|(k, _)| *k == key) {
            return Ok(tok.clone());
        }
        let tok = Arc::new(self.configure(max_length, padding)?);
        made.push((key, tok.clone()));
        Ok(tok)
    }

    fn configure(&self, max_length: usize, padding: Padding) -> Result<Tokenizer> {
        let mut tok = self.inner.clone();
        tok.with_truncation(Some(TruncationParams {
            direction: TruncationDirection::Right,
            max_length,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
        }))
        .map_err(|e| anyhow!("{}: {e}", self.path.display()))?;
        let strategy = match padding {
            Padding::Longest => Some(PaddingStrategy::BatchLongest),
            Padding::Fixed(n) => Some(PaddingStrategy::Fixed(n)),
            Padding::None => None,
        };
        tok.with_padding(strategy.map(|strategy| PaddingParams {
            strategy,
            direction: PaddingDirection::Right,
            pad_to_multiple_of: None,
            pad_id: self.pad_id,
            pad_type_id: 0,
            pad_token: self.pad_token.clone(),
        }));
        Ok(tok)
    }

    /// Token ids of one text without special tokens or truncation.
    pub fn ids(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let e = self.inner.encode(text, special).map_err(|e| anyhow!("{}: {e}", self.path.display()))?;
        Ok(e.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| anyhow!("{}: {e}", self.path.display()))
    }
}

/// Copy a tokenizer file into a checkpoint directory (atomically).
pub fn save_tokenizer(tok: &TextTokenizer, dir: &Path) -> Result<()> {
    let bytes = std::fs::read(tok.path()).with_context(|| format!("{}: cannot read", tok.path().display()))?;
    crate::fsutil::write_bytes(&dir.join("tokenizer.json"), &bytes)
}
