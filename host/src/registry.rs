//! Plugin discovery: `--plugin PATH` (repeatable), then `RAK_PLUGIN_PATH` (colon-separated
//! files or folders), then the folder of the `host` executable, where cargo puts the
//! workspace's cdylibs.
//!
//! Files named explicitly must be valid plugins (an error otherwise). Folders are scanned for
//! `*.so`; a library there that is not a rak plugin is skipped quietly, and an incompatible
//! plugin is skipped with a warning, so one stale file does not stop the host.

use crate::loader::{self, Module, Plugin};
use crate::proxy;
use anyhow::{anyhow, bail, Result};
use rak_core::abi::HeaderInfo;
use rak_core::plugin::{Connector, Encoder, Optimizer, Reader};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where plugins are looked for, in order.
#[derive(Debug, Clone)]
pub enum Source {
    /// A file named with `--plugin` or in `RAK_PLUGIN_PATH`.
    File(PathBuf),
    /// A folder to scan.
    Dir(PathBuf),
}

/// The search path for the given `--plugin` arguments and this process's environment.
pub fn search_path(explicit: &[PathBuf]) -> Vec<Source> {
    let mut out: Vec<Source> = explicit.iter().cloned().map(Source::File).collect();
    if let Some(var) = std::env::var_os("RAK_PLUGIN_PATH") {
        for p in std::env::split_paths(&var).filter(|p| !p.as_os_str().is_empty()) {
            out.push(if p.is_dir() { Source::Dir(p) } else { Source::File(p) });
        }
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        out.push(Source::Dir(dir));
    }
    out
}

/// The loaded plugins, by name.
pub struct Registry {
    plugins: BTreeMap<String, Plugin>,
    /// Files skipped while scanning folders, with the reason.
    pub skipped: Vec<String>,
}

impl Registry {
    /// Discover and load every plugin on the search path.
    pub fn discover(sources: &[Source]) -> Result<Self> {
        let mut headers: Vec<(PathBuf, HeaderInfo, bool)> = Vec::new();
        let mut skipped = Vec::new();
        for source in sources {
            match source {
                Source::File(path) => {
                    let header = loader::inspect(path)?;
                    loader::check_compatible(path, &header)?;
                    headers.push((path.clone(), header, true));
                }
                Source::Dir(dir) => {
                    for path in shared_objects(dir) {
                        let Ok(header) = loader::inspect(&path) else { continue };
                        match loader::check_compatible(&path, &header) {
                            Ok(()) => headers.push((path, header, false)),
                            Err(e) => skipped.push(format!("{e:#}")),
                        }
                    }
                }
            }
        }
        // The same file reached twice (e.g. --plugin on a file in the exe folder) is one plugin.
        let mut seen = std::collections::HashSet::new();
        headers.retain(|(p, _, _)| seen.insert(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())));

        let mut by_name: BTreeMap<String, PathBuf> = BTreeMap::new();
        for (path, h, _) in &headers {
            if let Some(first) = by_name.insert(h.name.clone(), path.clone()) {
                bail!(
                    "two plugins are named {:?}: {} and {}; remove one or rename it",
                    h.name,
                    first.display(),
                    path.display()
                );
            }
        }
        let mut plugins = BTreeMap::new();
        for (path, h, explicit) in headers {
            match loader::load(&path) {
                Ok(p) => {
                    plugins.insert(h.name.clone(), p);
                }
                Err(e) if explicit => return Err(e),
                Err(e) => skipped.push(format!("{e:#}")),
            }
        }
        Ok(Registry { plugins, skipped })
    }

    pub fn iter(&self) -> impl Iterator<Item = &Plugin> {
        self.plugins.values()
    }

    fn get(&self, name: &str, kind: &str) -> Result<&Plugin> {
        let p = self.plugins.get(name).ok_or_else(|| {
            let known: Vec<&str> =
                self.plugins.values().filter(|p| p.header.kind == kind).map(|p| p.header.name.as_str()).collect();
            anyhow!("no {kind} plugin named {name:?} (loaded {kind}s: {})", list_or_none(&known))
        })?;
        if p.header.kind != kind {
            bail!("plugin {name:?} ({}) is a {}, not a {kind}", p.path.display(), p.header.kind);
        }
        Ok(p)
    }

    /// The kind of the plugin `name` (`encoder`, `connector`, ...), if one is loaded.
    pub fn kind_of(&self, name: &str) -> Option<&str> {
        self.plugins.get(name).map(|p| p.header.kind.as_str())
    }

    /// Whether the plugin `name` declares the setting `key` (one that declares no settings
    /// at all takes any).
    pub fn takes_setting(&self, name: &str, key: &str) -> bool {
        self.plugins.get(name).is_some_and(|p| match proxy::settings_schema(p) {
            serde_json::Value::Object(known) => known.contains_key(key),
            _ => true,
        })
    }

    /// A new encoder instance from the plugin `name`.
    pub fn encoder(&self, name: &str, settings: &serde_json::Value) -> Result<Box<dyn Encoder>> {
        let p = self.get(name, "encoder")?;
        let Module::Encoder(m) = p.module else { unreachable!("kind checked above") };
        Ok(Box::new(proxy::EncoderProxy::create(p, m, settings)?))
    }

    /// A new optimizer instance from the plugin `name`.
    pub fn optimizer(&self, name: &str, settings: &serde_json::Value) -> Result<Box<dyn Optimizer>> {
        let p = self.get(name, "optimizer")?;
        let Module::Optimizer(m) = p.module else { unreachable!("kind checked above") };
        Ok(Box::new(proxy::OptimizerProxy::create(p, m, settings)?))
    }

    /// A new reader instance from the plugin `name`.
    pub fn reader(&self, name: &str, settings: &serde_json::Value) -> Result<Box<dyn Reader>> {
        let p = self.get(name, "reader")?;
        let Module::Reader(m) = p.module else { unreachable!("kind checked above") };
        Ok(Box::new(proxy::ReaderProxy::create(p, m, settings)?))
    }

    /// A new connector instance from the plugin `name`.
    pub fn connector(&self, name: &str, settings: &serde_json::Value) -> Result<Box<dyn Connector>> {
        let p = self.get(name, "connector")?;
        let Module::Connector(m) = p.module else { unreachable!("kind checked above") };
        Ok(Box::new(proxy::ConnectorProxy::create(p, m, settings)?))
    }

    /// The command plugin that provides subcommand `name`, if any.
    pub fn command(&self, name: &str) -> Option<&Plugin> {
        self.plugins.get(name).filter(|p| p.header.kind == "command")
    }
}

fn list_or_none(names: &[&str]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// `*.so` files directly in `dir`, sorted for a stable order.
fn shared_objects(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "so"))
        .collect();
    out.sort();
    out
}
