//! `.npy` files of 2-D little-endian `f32` arrays (format v1.0, C order), the layout
//! `numpy.save` writes for `float32` matrices, plus `ids.txt` (one id per line).
//!
//! Writing streams rows into `.NAME.partial` beside the target and patches the header's shape on
//! [`NpyWriter::finish`], which renames the file into place: a killed `encode` never leaves a
//! file that looks whole, and [`NpyWriter::resume`] continues the partial file after the last
//! whole row. Reading copies the values into memory ([`NpyF32`]) or streams them a block of
//! rows at a time ([`NpyRows`]); files are never memory-mapped (see [`NpyF32`] for why).

use crate::aligned::AlignedVec;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8] = b"\x93NUMPY";
/// Header bytes reserved by the writer (magic + version + len + dict, padded to 64 bytes).
/// The dict with a 20-digit row count still fits, so the shape can be patched in place.
const WRITER_HEADER_LEN: usize = 128;

fn header_dict(rows: usize, dim: usize) -> String {
    format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {dim}), }}")
}

/// The full header (magic .. newline) for a `[rows, dim]` array, padded to `total` bytes.
fn header_bytes(rows: usize, dim: usize, total: usize) -> Vec<u8> {
    let dict = header_dict(rows, dim);
    let mut h = Vec::with_capacity(total);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&[1, 0]);
    h.extend_from_slice(&((total - 10) as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    while h.len() < total - 1 {
        h.push(b' ');
    }
    h.push(b'\n');
    debug_assert_eq!(h.len(), total);
    h
}

/// Write a whole `[rows, dim]` matrix atomically.
pub fn write_f32(path: &Path, data: &[f32], dim: usize) -> Result<()> {
    let mut w = NpyWriter::create(path, dim)?;
    w.append(data)?;
    w.finish()
}

/// Streams rows of a `[?, dim]` f32 matrix into `path` (through a temporary file).
pub struct NpyWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    dim: usize,
    rows: usize,
}

impl NpyWriter {
    /// Start writing `path`; nothing appears under that name until [`finish`](Self::finish).
    pub fn create(path: &Path, dim: usize) -> Result<Self> {
        if dim == 0 {
            bail!("{}: cannot write an .npy matrix with 0 columns", path.display());
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create directory", dir.display()))?;
        }
        let tmp = partial_path(path);
        let file = File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&header_bytes(0, dim, WRITER_HEADER_LEN)).with_context(|| format!("{}: cannot write", tmp.display()))?;
        Ok(Self { path: path.to_path_buf(), tmp, out: Some(out), dim, rows: 0 })
    }

    /// Continue an interrupted write of `path`: keeps the whole rows already in the partial
    /// file (a torn last row is cut off) and returns the writer with [`rows`](Self::rows) set.
    /// Starts afresh when there is no partial file.
    pub fn resume(path: &Path, dim: usize) -> Result<Self> {
        let tmp = partial_path(path);
        let Ok(meta) = std::fs::metadata(&tmp) else { return Self::create(path, dim) };
        let len = meta.len() as usize;
        if len < WRITER_HEADER_LEN {
            return Self::create(path, dim);
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&tmp).with_context(|| format!("{}: cannot open", tmp.display()))?;
        let mut head = vec![0u8; WRITER_HEADER_LEN];
        std::io::Read::read_exact(&mut &file, &mut head)?;
        let (_, _, d) = parse_header(&head).with_context(|| format!("{}: not a partial .npy file", tmp.display()))?;
        if d != dim {
            bail!("{}: partial file has rows of width {d}, resuming with width {dim}", tmp.display());
        }
        let rows = (len - WRITER_HEADER_LEN) / (4 * dim);
        let keep = (WRITER_HEADER_LEN + rows * 4 * dim) as u64;
        file.set_len(keep)?;
        let mut file = file;
        file.seek(SeekFrom::Start(keep))?;
        Ok(Self { path: path.to_path_buf(), tmp, out: Some(BufWriter::with_capacity(1 << 20, file)), dim, rows })
    }

    /// Append whole rows (`values.len()` must be a multiple of the width).
    pub fn append(&mut self, values: &[f32]) -> Result<()> {
        if !values.len().is_multiple_of(self.dim) {
            bail!("{}: appending {} values, not a multiple of the row width {}", self.path.display(), values.len(), self.dim);
        }
        let out = self.out.as_mut().expect("NpyWriter used after finish");
        // f32 little-endian on disk; this crate targets little-endian machines only.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) };
        out.write_all(bytes).with_context(|| format!("{}: cannot write", self.tmp.display()))?;
        self.rows += values.len() / self.dim;
        Ok(())
    }

    /// Rows written so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Patch the header with the final shape, flush, fsync, rename into place and fsync the
    /// directory (so that a crash cannot keep the rename but lose the data, or lose the rename).
    pub fn finish(mut self) -> Result<()> {
        let out = self.out.take().expect("NpyWriter finished twice");
        let tmp = self.tmp.clone();
        let res = (|| -> Result<()> {
            let mut file = out.into_inner().map_err(|e| e.into_error()).with_context(|| format!("{}: cannot write", tmp.display()))?;
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&header_bytes(self.rows, self.dim, WRITER_HEADER_LEN))?;
            file.sync_all()?;
            Ok(())
        })()
        .with_context(|| format!("{}: cannot finish", tmp.display()));
        match res.and_then(|_| std::fs::rename(&tmp, &self.path).with_context(|| format!("{}: cannot move into place", self.path.display()))) {
            Ok(()) => rak_core::fsutil::sync_dir(match self.path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }
}

/// Where [`NpyWriter`] writes before `finish` (kept after a crash so that `resume` can continue).
pub fn partial_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.partial"))
}

/// A `[rows, dim]` f32 matrix read into memory.
///
/// Why not memory-mapped (as it once was): the files come from user directories (`encode`
/// output, an index's own `embeddings.npy` / `vectors.npy`), and any other program can
/// truncate or rewrite a file while it is mapped. Reading a mapped page past the new end of
/// the file raises SIGBUS, which kills the process, and a rewrite changes values after they
/// were checked (a NaN then outranks every score). Nothing prevents that for a mapping: file
/// locks are advisory and other programs ignore them, and a private mapping still reads
/// the file for every page it has not copied. A copy of our own does not change, so the values
/// are read with plain reads, once, and checked after. A search touches every vector (exact) or
/// most of them (HNSW) anyway, so the memory is the same as a mapping's once warm.
/// [`NpyRows`] streams a file instead, for work that needs one pass and no copy.
pub struct NpyF32 {
    path: PathBuf,
    /// Cache-line aligned: see `aligned`.
    data: AlignedVec,
    rows: usize,
    dim: usize,
}

impl NpyF32 {
    /// Read `path` after checking its header: version 1.0/2.0/3.0, `<f4`, C order, 2-D, and a
    /// file length that matches the shape.
    pub fn open(path: &Path) -> Result<Self> {
        let mut r = NpyRows::open(path)?;
        let (rows, dim) = (r.rows(), r.dim());
        let mut data = AlignedVec::zeroed(rows * dim);
        r.read_into(&mut data)?;
        Ok(Self { path: path.to_path_buf(), data, rows, dim })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// All values, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }
    /// The values, row-major, without a copy.
    pub fn into_values(self) -> AlignedVec {
        self.data
    }
}

/// Reads the rows of a `[rows, dim]` f32 `.npy` file a block at a time, with plain reads (see
/// [`NpyF32`] for why not a mapping): a file truncated meanwhile is an error, not a SIGBUS.
pub struct NpyRows {
    path: PathBuf,
    file: std::io::BufReader<File>,
    rows: usize,
    dim: usize,
    /// Rows handed out so far.
    done: usize,
}

impl NpyRows {
    /// Open `path` and check its header and length (as [`NpyF32::open`]); reads no rows yet.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let len = file.metadata().with_context(|| format!("{}: cannot stat", path.display()))?.len();
        let mut file = std::io::BufReader::with_capacity(1 << 20, file);
        let (offset, rows, dim) = read_header(&mut file).with_context(|| format!("{}: not a 2-D float32 .npy file", path.display()))?;
        let want = rows.checked_mul(dim).and_then(|n| n.checked_mul(4)).and_then(|n| n.checked_add(offset)).map(|w| w as u64);
        match want {
            Some(w) if w == len => {}
            Some(w) if w > len => bail!("{}: truncated: header says shape ({rows}, {dim}) = {w} bytes, file has {len}", path.display()),
            Some(w) => bail!("{}: {} trailing bytes after the ({rows}, {dim}) array", path.display(), len - w),
            None => bail!("{}: shape ({rows}, {dim}) overflows", path.display()),
        }
        Ok(Self { path: path.to_path_buf(), file, rows, dim, done: 0 })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Rows read so far (the index of the next row).
    pub fn position(&self) -> usize {
        self.done
    }

    /// Replace `buf` with the next rows, at most `max_rows` of them; returns how many
    /// (0 at the end).
    pub fn read_rows(&mut self, max_rows: usize, buf: &mut Vec<f32>) -> Result<usize> {
        let n = max_rows.min(self.rows - self.done);
        buf.clear();
        if buf.capacity() < n * self.dim {
            *buf = vec![0.0; n * self.dim]; // zeroed by the allocator, not written twice
        } else {
            buf.resize(n * self.dim, 0.0);
        }
        if self.dim == 0 {
            // No bytes to read, but the rows are handed out all the same.
            self.done += n;
            return Ok(n);
        }
        self.read_into(buf)?;
        Ok(n)
    }

    /// Fill `out` with the next `out.len() / dim` rows (a whole number of them, at most the
    /// rows left).
    pub fn read_into(&mut self, out: &mut [f32]) -> Result<()> {
        let n = if self.dim == 0 { 0 } else { out.len() / self.dim };
        if n * self.dim != out.len() || n > self.rows - self.done {
            bail!("{}: cannot read {} values as rows of {} ({} rows left)", self.path.display(), out.len(), self.dim, self.rows - self.done);
        }
        // f32 little-endian on disk; this crate targets little-endian machines only.
        // Safety: any bytes are a valid f32; the view covers exactly `out`'s values.
        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(out)) };
        std::io::Read::read_exact(&mut self.file, bytes).with_context(|| {
            format!("{}: cannot read rows {}..{} (was the file changed while being read?)", self.path.display(), self.done, self.done + n)
        })?;
        self.done += n;
        Ok(())
    }
}

/// Read and parse the header at the start of `r`, leaving `r` at the first value.
fn read_header(r: &mut impl std::io::Read) -> Result<(usize, usize, usize)> {
    // Magic, version and the header length (2 bytes in v1, 4 in v2/v3), then the header.
    let mut head = vec![0u8; 10];
    let eof = |e: std::io::Error| if e.kind() == std::io::ErrorKind::UnexpectedEof { anyhow::anyhow!("missing the \\x93NUMPY magic or truncated header") } else { e.into() };
    r.read_exact(&mut head).map_err(eof)?;
    if &head[..6] != MAGIC {
        bail!("missing the \\x93NUMPY magic");
    }
    let hlen = match head[6] {
        1 => u16::from_le_bytes([head[8], head[9]]) as usize,
        2 | 3 => {
            head.resize(12, 0);
            r.read_exact(&mut head[10..]).map_err(eof)?;
            u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize
        }
        _ => 0, // parse_header names the version
    };
    let start = head.len();
    head.resize(start + hlen, 0);
    r.read_exact(&mut head[start..]).map_err(|e| if e.kind() == std::io::ErrorKind::UnexpectedEof { anyhow::anyhow!("truncated header") } else { e.into() })?;
    parse_header(&head)
}

fn parse_header(b: &[u8]) -> Result<(usize, usize, usize)> {
    if b.len() < 10 || &b[..6] != MAGIC {
        bail!("missing the \\x93NUMPY magic");
    }
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 => {
            if b.len() < 12 {
                bail!("truncated header");
            }
            (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12)
        }
        v => bail!("unsupported .npy version {v}.{}", b[7]),
    };
    let end = start + hlen;
    if b.len() < end {
        bail!("truncated header ({} bytes, header says {end})", b.len());
    }
    let dict = std::str::from_utf8(&b[start..end]).context("header is not text")?;
    let descr = dict_value(dict, "descr").context("header has no 'descr'")?;
    let descr = descr.trim_matches(|c| c == '\'' || c == '"');
    if descr != "<f4" {
        bail!("dtype is {descr:?}, expected '<f4' (little-endian float32); convert with arr.astype('<f4')");
    }
    let fortran = dict_value(dict, "fortran_order").context("header has no 'fortran_order'")?;
    if fortran != "False" {
        bail!("array is in Fortran order; save a C-ordered copy (np.ascontiguousarray)");
    }
    let shape = dict_value(dict, "shape").context("header has no 'shape'")?;
    let dims: Vec<usize> = shape
        .trim_matches(|c| c == '(' || c == ')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().with_context(|| format!("bad shape {shape}")))
        .collect::<Result<_>>()?;
    if dims.len() != 2 {
        bail!("shape is {shape}, expected 2-D (rows, dim)");
    }
    Ok((end, dims[0], dims[1]))
}

/// The raw text of `key`'s value in a Python dict literal (values here never contain `,` except
/// inside the shape tuple, which is handled by matching parentheses).
fn dict_value<'a>(dict: &'a str, key: &str) -> Option<&'a str> {
    let pat_a = format!("'{key}'");
    let pat_b = format!("\"{key}\"");
    let at = dict.find(&pat_a).map(|i| i + pat_a.len()).or_else(|| dict.find(&pat_b).map(|i| i + pat_b.len()))?;
    let rest = dict[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') { rest.find(')')? + 1 } else { rest.find([',', '}'])? };
    Some(rest[..end].trim())
}

/// Read `ids.txt`: one id per line, no empty lines.
pub fn read_ids(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read ids", path.display()))?;
    let ids: Vec<String> = text.lines().map(|l| l.strip_suffix('\r').unwrap_or(l).to_string()).collect();
    if let Some(i) = ids.iter().position(|s| s.is_empty()) {
        bail!("{}: line {} is empty; every line must hold one id", path.display(), i + 1);
    }
    Ok(ids)
}

/// Write `ids.txt` atomically. Ids must be non-empty and contain no line breaks.
pub fn write_ids(path: &Path, ids: &[impl AsRef<str>]) -> Result<()> {
    let mut text = String::new();
    for (i, id) in ids.iter().enumerate() {
        let id = id.as_ref();
        if id.is_empty() || id.contains(['\n', '\r']) {
            bail!("{}: id #{i} {id:?} is empty or contains a line break", path.display());
        }
        text.push_str(id);
        text.push('\n');
    }
    rak_core::fsutil::write_bytes(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `(rows, 0)` file has no bytes to read, but its rows are still handed out once each:
    /// a loop reading until 0 ends.
    #[test]
    fn rows_of_zero_width_are_handed_out_once() {
        let path = std::env::temp_dir().join(format!("rak-npy-{}-zero-width.npy", std::process::id()));
        std::fs::write(&path, header_bytes(5, 0, WRITER_HEADER_LEN)).unwrap();
        let mut r = NpyRows::open(&path).unwrap();
        let mut buf = Vec::new();
        assert_eq!(r.read_rows(3, &mut buf).unwrap(), 3);
        assert_eq!(r.read_rows(3, &mut buf).unwrap(), 2);
        assert_eq!(r.read_rows(3, &mut buf).unwrap(), 0);
        assert!(buf.is_empty());
        let m = NpyF32::open(&path).unwrap();
        assert_eq!((m.rows(), m.dim(), m.data().len()), (5, 0, 0));
        std::fs::remove_file(&path).unwrap();
    }
}
