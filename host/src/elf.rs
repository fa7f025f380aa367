//! Reading a candidate plugin file without loading it.
//!
//! `dlopen` runs a library's initialisers, and on a truncated file whose ELF header is intact
//! the loader maps pages past the end of the file and the whole process dies of SIGBUS. So
//! before anything is loaded we parse the file ourselves: it must be a 64-bit shared object for
//! this machine, every segment and section must lie inside the file, and it must export the
//! plugin header, which we read from the file bytes.

use object::elf;
use object::read::elf::{ElfFile64, FileHeader, ProgramHeader, SectionHeader};
use object::{Endianness, Object, ObjectSection, ObjectSymbol};
use rak_core::abi::header::{HeaderInfo, HEADER_SIZE, HEADER_SYMBOL};
use std::path::Path;

/// Why a file is not a loadable plugin: one phrase, to follow "<file>: ".
#[derive(Debug)]
pub struct Rejection(pub String);

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn reject<T>(msg: impl Into<String>) -> Result<T, Rejection> {
    Err(Rejection(msg.into()))
}

/// Validate `path` as an ELF shared object and read its plugin header.
pub fn read_plugin_header(path: &Path) -> Result<HeaderInfo, Rejection> {
    let data = std::fs::read(path).or_else(|e| reject(format!("cannot read it: {e}")))?;
    if data.len() < 4 || &data[..4] != b"\x7fELF" {
        return reject("not a shared library (no ELF magic number)");
    }
    if data.get(4) != Some(&elf::ELFCLASS64) {
        return reject("not a 64-bit ELF file");
    }
    let file = ElfFile64::<Endianness>::parse(&*data)
        .or_else(|e| reject(format!("not a valid ELF file, truncated or corrupt ({e})")))?;
    let endian = file.endian();
    let header = file.elf_header();
    if header.e_type(endian) != elf::ET_DYN {
        return reject("an ELF file but not a shared library");
    }
    if header.e_machine(endian) != host_machine() {
        return reject(format!(
            "built for ELF machine {}, this host is machine {}",
            header.e_machine(endian),
            host_machine()
        ));
    }
    let len = data.len() as u64;
    for ph in file.elf_program_headers() {
        let end = ph.p_offset(endian).checked_add(ph.p_filesz(endian));
        if end.is_none_or(|end| end > len) {
            return reject(format!("truncated: a segment ends past the file's {len} bytes"));
        }
    }
    for sh in file.elf_section_table().iter() {
        if sh.sh_type(endian) == elf::SHT_NOBITS {
            continue;
        }
        let end = sh.sh_offset(endian).checked_add(sh.sh_size(endian));
        if end.is_none_or(|end| end > len) {
            return reject(format!("truncated: a section ends past the file's {len} bytes"));
        }
    }
    let symbol = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok(HEADER_SYMBOL))
        .ok_or_else(|| Rejection(format!("a shared library but not a rak plugin (it exports no {HEADER_SYMBOL})")))?;
    let section = symbol
        .section_index()
        .and_then(|i| file.section_by_index(i).ok())
        .ok_or_else(|| Rejection(format!("its {HEADER_SYMBOL} symbol points to no section")))?;
    let bytes = section.data().or_else(|e| reject(format!("cannot read the plugin header: {e}")))?;
    let start = symbol.address().checked_sub(section.address()).map(|o| o as usize);
    let raw = start
        .and_then(|s| bytes.get(s..s.checked_add(HEADER_SIZE)?))
        .ok_or_else(|| Rejection("its plugin header lies outside its section".into()))?;
    HeaderInfo::parse(raw).map_err(Rejection)
}

fn host_machine() -> u16 {
    if cfg!(target_arch = "x86_64") {
        elf::EM_X86_64
    } else if cfg!(target_arch = "aarch64") {
        elf::EM_AARCH64
    } else {
        elf::EM_NONE
    }
}
