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
/// model).
pub fn save_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut views = BTreeMap::new();
    for (name, t) in tensors {
        views.insert(name.as_str(), TensorBytes::new(t).with_context(|| format!("{}: tensor {name}", path.display()))?);
    }
    crate::fsutil::write_atomically(path, |tmp| {
        safetensors::serialize_to_file(views, None, tmp).map_err(|e| anyhow!("{}: cannot write: {e}", tmp.display()))
    })
}

/// A tensor as safetensors sees it: its dtype, shape and bytes.
struct TensorBytes<'a> {
    tensor: &'a Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
}

impl<'a> TensorBytes<'a> {
    fn new(tensor: &'a Tensor) -> Result<Self> {
        let kind = tensor.kind();
        let dtype = match kind {
            Kind::Float => Dtype::F32,
            Kind::Half => Dtype::F16,
            Kind::BFloat16 => Dtype::BF16,
            Kind::Double => Dtype::F64,
            Kind::Int64 => Dtype::I64,
            Kind::Int => Dtype::I32,
            Kind::Uint8 => Dtype::U8,
            Kind::Bool => Dtype::BOOL,
            other => bail!("cannot store dtype {other:?}"),
        };
        let shape: Vec<usize> = tensor.size().iter().map(|&d| d as usize).collect();
        Ok(TensorBytes { tensor, dtype, shape, len: tensor.numel() * kind.elt_size_in_bytes() })
    }
}

impl safetensors::View for TensorBytes<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
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
    fn data_len(&self) -> usize {
        self.len
    }
}
