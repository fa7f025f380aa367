//! The compatibility header: a plain static every plugin exports under [`HEADER_SYMBOL`].
//!
//! It holds no pointers (only fixed-size byte arrays), so it lives in `.rodata` with no
//! relocations and the host reads it straight from the file **before** `dlopen`, i.e. before
//! any code of the plugin (not even its static initialisers) runs. Field offsets are fixed
//! forever; new information goes into the kind's prefix-type root module instead.

use super::PluginKind;

/// The symbol name of the header in every plugin's dynamic symbol table.
pub const HEADER_SYMBOL: &str = "RAK_PLUGIN_HEADER";
/// First bytes of every header.
pub const MAGIC: [u8; 8] = *b"RAKPLUG\0";

const NAME_LEN: usize = 64;
const VERSION_LEN: usize = 32;
const TCH_LEN: usize = 32;
const LIBTORCH_LEN: usize = 64;
const TARGET_LEN: usize = 64;

/// The in-memory layout; see the module docs. Build it with [`PluginHeader::new`].
#[repr(C)]
pub struct PluginHeader {
    pub magic: [u8; 8],
    pub header_size: u32,
    pub abi_version: u32,
    pub kind: u32,
    pub reserved: u32,
    pub name: [u8; NAME_LEN],
    pub version: [u8; VERSION_LEN],
    pub tch_version: [u8; TCH_LEN],
    pub libtorch_version: [u8; LIBTORCH_LEN],
    pub target: [u8; TARGET_LEN],
}

/// Size in bytes of the header as stored in the file.
pub const HEADER_SIZE: usize = std::mem::size_of::<PluginHeader>();

const fn fixed<const N: usize>(s: &str) -> [u8; N] {
    let bytes = s.as_bytes();
    assert!(bytes.len() < N, "plugin header field too long");
    let mut out = [0u8; N];
    let mut i = 0;
    while i < bytes.len() {
        out[i] = bytes[i];
        i += 1;
    }
    out
}

impl PluginHeader {
    /// The header a plugin built against this copy of rak-core exports.
    pub const fn new(kind: PluginKind, name: &str, version: &str) -> Self {
        Self::with_abi(kind, name, version, super::ABI_VERSION)
    }

    const fn with_abi(kind: PluginKind, name: &str, version: &str, abi_version: u32) -> Self {
        PluginHeader {
            magic: MAGIC,
            header_size: HEADER_SIZE as u32,
            abi_version,
            kind: kind as u32,
            reserved: 0,
            name: fixed(name),
            version: fixed(version),
            tch_version: fixed(crate::TCH_VERSION),
            libtorch_version: fixed(crate::LIBTORCH_VERSION),
            target: fixed(crate::TARGET),
        }
    }
}

/// A header as read back from a file: owned strings, ready to compare and print.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HeaderInfo {
    pub abi_version: u32,
    pub kind: String,
    pub name: String,
    pub version: String,
    pub tch_version: String,
    pub libtorch_version: String,
    pub target: String,
}

impl HeaderInfo {
    /// What this build of the toolkit itself would write.
    pub fn this_build() -> Self {
        HeaderInfo {
            abi_version: super::ABI_VERSION,
            kind: String::new(),
            name: String::new(),
            version: String::new(),
            tch_version: crate::TCH_VERSION.into(),
            libtorch_version: crate::LIBTORCH_VERSION.into(),
            target: crate::TARGET.into(),
        }
    }

    /// Parse the raw bytes of a header. Errors say what is wrong in a phrase.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() < 24 || bytes[..8] != MAGIC {
            return Err("its plugin header has a bad magic number".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let size = u32_at(8) as usize;
        if size < HEADER_SIZE || bytes.len() < HEADER_SIZE {
            return Err(format!("its plugin header is {size} bytes, expected at least {HEADER_SIZE}"));
        }
        let kind_id = u32_at(16);
        let kind = PluginKind::from_u32(kind_id)
            .map(|k| k.as_str().to_string())
            .unwrap_or_else(|| format!("unknown({kind_id})"));
        let mut off = 24;
        let mut text = |len: usize| {
            let field = &bytes[off..off + len];
            off += len;
            let end = field.iter().position(|&b| b == 0).unwrap_or(len);
            String::from_utf8_lossy(&field[..end]).into_owned()
        };
        Ok(HeaderInfo {
            abi_version: u32_at(12),
            kind,
            name: text(NAME_LEN),
            version: text(VERSION_LEN),
            tch_version: text(TCH_LEN),
            libtorch_version: text(LIBTORCH_LEN),
            target: text(TARGET_LEN),
        })
    }

    /// `None` when a plugin with this header may be loaded into this host, else the reason,
    /// naming both sides.
    pub fn incompatibility(&self) -> Option<String> {
        let host = Self::this_build();
        let check = |what: &str, plugin: &str, ours: &str| {
            (plugin != ours).then(|| format!("it was built for {what} {plugin}, this host has {what} {ours}"))
        };
        if self.abi_version != host.abi_version {
            return Some(format!(
                "it was built for plugin ABI version {}, this host has plugin ABI version {}",
                self.abi_version, host.abi_version
            ));
        }
        check("target", &self.target, &host.target)
            .or_else(|| check("libtorch", &self.libtorch_version, &host.libtorch_version))
            .or_else(|| check("tch", &self.tch_version, &host.tch_version))
            .or_else(|| {
                self.kind.starts_with("unknown").then(|| format!("its plugin kind is {}", self.kind))
            })
    }
}

/// Serialise a header to its on-disk bytes (used by tests that forge headers).
pub fn header_bytes(h: &PluginHeader) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_SIZE);
    out.extend_from_slice(&h.magic);
    for v in [h.header_size, h.abi_version, h.kind, h.reserved] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for field in [&h.name[..], &h.version, &h.tch_version, &h.libtorch_version, &h.target] {
        out.extend_from_slice(field);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let h = PluginHeader::new(PluginKind::Optimizer, "adamw", "1.2.3");
        let bytes = header_bytes(&h);
        assert_eq!(bytes.len(), HEADER_SIZE);
        // The serialised form must be the in-memory form: the host reads the latter from files.
        let raw = unsafe { std::slice::from_raw_parts(&h as *const _ as *const u8, HEADER_SIZE) };
        assert_eq!(raw, &bytes[..]);
        let info = HeaderInfo::parse(&bytes).unwrap();
        assert_eq!(info.name, "adamw");
        assert_eq!(info.kind, "optimizer");
        assert_eq!(info.version, "1.2.3");
        assert_eq!(info.incompatibility(), None);
    }

    #[test]
    fn mismatches_name_both_sides() {
        let mut info = HeaderInfo::parse(&header_bytes(&PluginHeader::new(PluginKind::Encoder, "e", "0"))).unwrap();
        info.abi_version += 1;
        let msg = info.incompatibility().unwrap();
        assert!(msg.contains(&format!("{}", crate::ABI_VERSION + 1)) && msg.contains(&format!("{}", crate::ABI_VERSION)));
        info.abi_version -= 1;
        info.libtorch_version = "2.10.0".into();
        let msg = info.incompatibility().unwrap();
        assert!(msg.contains("2.10.0") && msg.contains(crate::LIBTORCH_VERSION), "{msg}");
    }

    #[test]
    fn bad_magic_is_an_error() {
        assert!(HeaderInfo::parse(b"not a header at all, definitely").is_err());
    }
}
