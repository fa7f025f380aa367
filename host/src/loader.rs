//! Loading one plugin file: header check first, then `dlopen` and the kind's root module.

use crate::elf::read_plugin_header;
use abi_stable::library::{lib_header_from_path, LibraryError, RootModule};
use anyhow::{anyhow, bail, Result};
use rak_core::abi::modules::*;
use rak_core::abi::HeaderInfo;
use std::path::{Path, PathBuf};

/// A plugin's root module, by kind.
#[derive(Clone, Copy)]
pub enum Module {
    Encoder(EncoderModRef),
    Optimizer(OptimizerModRef),
    Reader(ReaderModRef),
    Connector(ConnectorModRef),
    Command(CommandModRef),
}

/// A loaded plugin. Libraries are never unloaded: tensors and objects they created may
/// outlive any handle we could drop.
#[derive(Clone)]
pub struct Plugin {
    pub path: PathBuf,
    pub header: HeaderInfo,
    pub module: Module,
}

/// Read and check the header of `path` without loading it. The error is one line naming
/// the file and the reason.
pub fn inspect(path: &Path) -> Result<HeaderInfo> {
    read_plugin_header(path).map_err(|r| anyhow!("{}: {r}", path.display()))
}

/// Refuse a plugin whose header does not match this host, naming both sides.
pub fn check_compatible(path: &Path, header: &HeaderInfo) -> Result<()> {
    match header.incompatibility() {
        Some(why) => bail!("{}: incompatible plugin {:?}: {why}", path.display(), header.name),
        None => Ok(()),
    }
}

/// Check compatibility, then load. Nothing from the file runs before the header check passes.
///
/// Both steps use the file's canonical path: `dlopen` of a name without a slash would search
/// the library path instead of the current folder, loading another file than the one checked.
pub fn load(path: &Path) -> Result<Plugin> {
    let path = &std::fs::canonicalize(path).map_err(|e| anyhow!("{}: cannot open: {e}", path.display()))?;
    let header = inspect(path)?;
    check_compatible(path, &header)?;
    let lib = lib_header_from_path(path).map_err(|e| load_error(path, e))?;
    let module = match header.kind.as_str() {
        "encoder" => Module::Encoder(init(path, lib)?),
        "optimizer" => Module::Optimizer(init(path, lib)?),
        "reader" => Module::Reader(init(path, lib)?),
        "connector" => Module::Connector(init(path, lib)?),
        "command" => Module::Command(init(path, lib)?),
        other => bail!("{}: unknown plugin kind {other}", path.display()),
    };
    Ok(Plugin { path: path.to_path_buf(), header, module })
}

fn init<M: RootModule>(path: &Path, lib: &'static abi_stable::library::LibHeader) -> Result<M> {
    lib.init_root_module::<M>().map_err(|e| load_error(path, e))
}

/// abi_stable's errors can be pages long (full type layouts) and spread over lines; keep one
/// line of at most a few hundred characters.
fn load_error(path: &Path, e: LibraryError) -> anyhow::Error {
    let text = e.to_string();
    let mut line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > 300 {
        line.truncate(line.char_indices().nth(297).map_or(line.len(), |(i, _)| i));
        line.push_str("...");
    }
    anyhow!("{}: cannot load plugin: {line}", path.display())
}
