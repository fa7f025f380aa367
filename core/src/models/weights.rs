//! Hugging Face checkpoint files: reading `model.safetensors` (or a sharded
//! `model.safetensors.index.json`) memory-mapped, and writing them back atomically.
//!
//! Tensors are copied once, from the mapped file straight into the model's parameter, so a
//! checkpoint never sits in RAM twice. Every error names the file, and the tensor when there is
//! one.

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Device, Kind, Tensor};

/// An opened checkpoint: one or more mapped safetensors files and where each tensor lives.
pub struct Checkpoint {
    files: Vec<(PathBuf, Mmap)>,
    location: HashMap<String, usize>,
}

impl Checkpoint {
    /// Open `dir/model.safetensors`, or the shards listed in `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).with_context(|| format!("{}: cannot read", index.display()))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index.display()))?;
            let map = json["weight_map"]
                .as_object()
                .ok_or_else(|| anyhow!("{}: no \"weight_map\" object", index.display()))?;
            let mut shards: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
            shards.sort();
            shards.dedup();
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else {
            bail!("{}: no model.safetensors (nor model.safetensors.index.json) in this directory", dir.display());
        };
        let mut files = Vec::new();
        let mut location = HashMap::new();
        for (i, path) in paths.into_iter().enumerate() {
            let file = std::fs::File::open(&path).with_context(|| format!("{}: cannot open", path.display()))?;
            // SAFETY: the mapping is read-only; a checkpoint modified while we read it is the
            // user's race, as with any file reader.
            let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("{}: cannot map", path.display()))?;
            let (_, meta) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| anyhow!("{}: not a valid safetensors file ({e})", path.display()))?;
            for name in meta.tensors().keys() {
                location.insert(name.clone(), i);
            }
            files.push((path, mmap));
        }
        Ok(Checkpoint { files, location })
    }

    /// Every tensor name in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// The file holding `name` (for messages).
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.location.get(name).map(|&i| self.files[i].0.as_path())
    }

    /// Read one tensor (on the CPU, in its stored dtype).
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let &i = self.location.get(name).ok_or_else(|| anyhow!("checkpoint has no tensor {name:?}"))?;
        let (path, mmap) = &self.files[i];
        let st = SafeTensors::deserialize(mmap).map_err(|e| anyhow!("{}: corrupt ({e})", path.display()))?;
        let view = st.tensor(name).map_err(|e| anyhow!("{}: tensor {name}: {e}", path.display()))?;
        let kind = match view.dtype() {
            Dtype::F32 => Kind::Float,
            Dtype::F16 => Kind::Half,
            Dtype::BF16 => Kind::BFloat16,
            Dtype::F64 => Kind::Double,
            Dtype::I64 => Kind::Int64,
            Dtype::I32 => Kind::Int,
            Dtype::I16 => Kind::Int16,
            Dtype::I8 => Kind::Int8,
            Dtype::U8 => Kind::Uint8,
            Dtype::BOOL => Kind::Bool,
            other => bail!("{}: tensor {name} has unsupported dtype {other:?}", path.display()),
        };
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        Tensor::f_from_data_size(view.data(), &shape, kind)
            .map_err(|e| anyhow!("{}: tensor {name}: {e}", path.display()))
    }

    /// Fill every variable of `vs` from the checkpoint. A variable `name` is looked up as
    /// `prefix + name` for each of `prefixes` in turn, then through `aliases` (tied weights
    /// saved under another name). Shapes must agree exactly: a mismatch means the checkpoint
    /// and its `config.json` disagree.
    pub fn load_into(&self, vs: &mut VarStore, prefixes: &[&str], aliases: &[(&str, &str)]) -> Result<()> {
        let device = vs.device();
        let _guard = tch::no_grad_guard();
        for (name, mut var) in vs.variables() {
            let candidates = prefixes
                .iter()
                .map(|p| format!("{p}{name}"))
                .chain(aliases.iter().filter(|(n, _)| *n == name).map(|(_, a)| a.to_string()));
            let Some(found) = candidates.into_iter().find(|c| self.contains(c)) else {
                bail!("{}: missing tensor {name}", self.describe());
            };
            let src = self.tensor(&found)?;
            if src.size() != var.size() {
                bail!(
                    "{}: tensor {found} has shape {:?}, but config.json implies {:?}",
                    self.file_of(&found).unwrap().display(),
                    src.size(),
                    var.size()
                );
            }
            var.copy_(&src.to_device(device).to_kind(var.kind()));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        match self.files.as_slice() {
            [(p, _)] => p.display().to_string(),
            files => format!("{} (sharded, {} files)", files[0].0.parent().unwrap_or(Path::new(".")).display(), files.len()),
        }
    }
}

/// Write named tensors as one safetensors file, atomically (temporary name, then rename).
/// Tensors are stored contiguous, in their own dtype. A contiguous CPU tensor is written
/// straight from its memory; any other is copied to the CPU when its turn comes, so a
/// checkpoint never holds a second copy of the state (T-SAGE's momentum alone is T times the
/// model). The format is written here, not by the safetensors crate, whose writer goes
/// through a temporary file of its own (mode 0600, and a name our clean-up of a killed
/// write does not know).
pub fn save_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    use std::io::Write;
    let mut views = BTreeMap::new();
    for (name, t) in tensors {
        views.insert(name.as_str(), TensorBytes::new(t).with_context(|| format!("{}: tensor {name}", path.display()))?);
    }
    // The header: each tensor's dtype, shape and byte range, the ranges back to back in name
    // order; padded with spaces to a multiple of 8 bytes, as the reference writer does.
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, v) in &views {
        header.insert(name.to_string(), serde_json::json!({"dtype": v.dtype, "shape": v.shape, "data_offsets": [offset, offset + v.len]}));
        offset += v.len;
    }
    let mut text = serde_json::to_string(&header)?;
    text.push_str(&" ".repeat((8 - text.len() % 8) % 8));
    crate::fsutil::write_atomically(path, |tmp| {
        let file = std::fs::File::create(tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        let mut out = std::io::BufWriter::new(file);
        let io = |e: std::io::Error| anyhow!("{}: cannot write: {e}", tmp.display());
        out.write_all(&(text.len() as u64).to_le_bytes()).map_err(io)?;
        out.write_all(text.as_bytes()).map_err(io)?;
        for v in views.values() {
            out.write_all(&v.bytes()).map_err(io)?;
        }
        out.flush().map_err(io)
    })
}

/// A tensor as the safetensors format stores it: its dtype name, shape and bytes.
struct TensorBytes<'a> {
    tensor: &'a Tensor,
    dtype: &'static str,
    shape: Vec<usize>,
    len: usize,
}

impl<'a> TensorBytes<'a> {
    fn new(tensor: &'a Tensor) -> Result<Self> {
        let kind = tensor.kind();
        let dtype = match kind {
            Kind::Float => "F32",
            Kind::Half => "F16",
            Kind::BFloat16 => "BF16",
            Kind::Double => "F64",
            Kind::Int64 => "I64",
            Kind::Int => "I32",
            Kind::Int16 => "I16",
            Kind::Int8 => "I8",
            Kind::Uint8 => "U8",
            Kind::Bool => "BOOL",
            other => bail!("cannot store dtype {other:?}"),
        };
        let shape: Vec<usize> = tensor.size().iter().map(|&d| d as usize).collect();
        Ok(TensorBytes { tensor, dtype, shape, len: tensor.numel() * kind.elt_size_in_bytes() })
    }

    fn bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        let t = self.tensor;
        if self.len == 0 {
            return std::borrow::Cow::Borrowed(&[]);
        }
        if t.device() == Device::Cpu && t.is_contiguous() {
            // SAFETY: a contiguous CPU tensor of `len` bytes, borrowed for `self`'s lifetime.
            return std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, self.len) });
        }
        let cpu = t.detach().to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; self.len];
        cpu.copy_data_u8(&mut bytes, cpu.numel());
        bytes.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every dtype and shape a checkpoint holds comes back equal through our reader, tch's and
    /// the safetensors crate's checks; views and non-contiguous tensors are written as their
    /// values; the file gets the same mode as any other file this process creates.
    #[test]
    fn safetensors_round_trip() {
        let dir = std::env::temp_dir().join(format!("rak-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([4, 6]);
        let tensors: Vec<(String, Tensor)> = vec![
            ("f32".into(), base.copy()),
            ("transposed".into(), base.tr()),
            ("row_view".into(), base.get(2)),
            ("scalar".into(), Tensor::from(7i64)),
            ("empty".into(), Tensor::zeros([0, 3], (Kind::Float, Device::Cpu))),
            ("bf16".into(), base.to_kind(Kind::BFloat16)),
            ("f16".into(), base.to_kind(Kind::Half)),
            ("f64".into(), base.to_kind(Kind::Double)),
            ("i32".into(), base.to_kind(Kind::Int)),
            ("i16".into(), base.to_kind(Kind::Int16)),
            ("i8".into(), base.to_kind(Kind::Int8)),
            ("u8".into(), base.to_kind(Kind::Uint8)),
            ("bool".into(), base.gt(10.0)),
        ];
        let path = dir.join("model.safetensors");
        save_safetensors(&path, &tensors).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!(header_len % 8, 0, "header padded to 8 bytes");
        let parsed = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(parsed.len(), tensors.len());
        let ours = Checkpoint::open(&dir).unwrap();
        let theirs: BTreeMap<String, Tensor> = Tensor::read_safetensors(&path).unwrap().into_iter().collect();
        for (name, t) in &tensors {
            let back = ours.tensor(name).unwrap();
            assert_eq!(back.kind(), t.kind(), "{name}");
            assert_eq!(back.size(), t.size(), "{name}");
            assert!(back.equal(t), "{name}: {back} vs {t}");
            assert!(theirs[name].equal(t), "{name} through tch's reader");
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let other = dir.join("other");
            std::fs::write(&other, b"x").unwrap();
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&path), mode(&other), "a checkpoint gets the process's usual file mode");
        }
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).filter(|n| n != "model.safetensors" && n != "other").collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
