//! Writing a GGUF file: header, metadata and tensor infos first, then tensor
//! data streamed in declaration order (a 20 GB model never sits in memory),
//! into a temporary file beside the target that is renamed into place by
//! [`GgufWriter::finish`].

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use slipstream_outpath::Overwrite;

use crate::types::{GgmlType, Value};
use crate::{
    align_up, GgufError, GgufFile, Result, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, VERSION,
};

/// A tensor to be written.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorDecl {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorDecl {
    pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType) -> Self {
        TensorDecl {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
        }
    }
}

struct Slot {
    decl: TensorDecl,
    nbytes: u64,
    /// Offset relative to the data section.
    rel: u64,
}

/// Streaming GGUF writer; see the module doc.
pub struct GgufWriter {
    target: PathBuf,
    overwrite: Overwrite,
    tmp: PathBuf,
    out: BufWriter<File>,
    slots: Vec<Slot>,
    /// Index of the tensor being written.
    cur: usize,
    /// Bytes of the current tensor written so far.
    cur_done: u64,
    /// Bytes written to the data section so far.
    data_pos: u64,
    finished: bool,
}

/// Whether `path` is a regular file that starts like a GGUF (or is empty: a
/// writer killed before its first flush).
fn is_gguf_leftover(path: &Path) -> bool {
    fs::symlink_metadata(path)
        .is_ok_and(|m| m.is_file() && (m.len() == 0 || crate::is_gguf_file(path)))
}

/// Checks that writing a GGUF to `target` loses nothing the user did not
/// ask to replace: only a file that opens as a valid GGUF is replaced, a
/// damaged GGUF with [`Overwrite::Force`]. Touches nothing.
pub fn check_gguf_target(target: &Path, overwrite: Overwrite) -> Result<()> {
    let refuse = |why: &str| {
        Err(GgufError::Invalid {
            path: target.display().to_string(),
            what: format!(
                "{why}; nothing was written or removed. Choose another --output, or remove it yourself"
            ),
        })
    };
    let meta = match fs::symlink_metadata(target) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(target, e)),
    };
    if !meta.is_file() {
        return refuse("exists and is not a regular file");
    }
    if !crate::is_gguf_file(target) {
        return refuse("exists and is not a GGUF file");
    }
    match GgufFile::open(target) {
        Ok(_) => Ok(()),
        Err(_) if overwrite == Overwrite::Force => Ok(()),
        Err(e) => refuse(&format!(
            "is a damaged GGUF file ({e}); pass --force to replace it"
        )),
    }
}

fn io(path: &Path, e: std::io::Error) -> GgufError {
    GgufError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value, path: &Path) -> Result<()> {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(*x as u8),
        Value::String(s) => put_str(buf, s),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Array { ty, items } => {
            buf.extend_from_slice(&(*ty as u32).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                if it.value_type() != *ty {
                    return Err(GgufError::Invalid {
                        path: path.display().to_string(),
                        what: format!("array of {ty:?} holds a {:?} item", it.value_type()),
                    });
                }
                put_value(buf, it, path)?;
            }
        }
    }
    Ok(())
}

impl GgufWriter {
    /// Creates the temporary file and writes everything before the data
    /// section. The alignment is `general.alignment` when `metadata` sets it.
    pub fn create(
        target: &Path,
        metadata: &[(String, Value)],
        tensors: Vec<TensorDecl>,
        overwrite: Overwrite,
    ) -> Result<Self> {
        let bad = |what: String| GgufError::Invalid {
            path: target.display().to_string(),
            what,
        };
        let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT as u64,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(bad(format!(
                        "{ALIGNMENT_KEY} = {v:?} is not a power of two"
                    )))
                }
            },
        };
        let mut head = Vec::new();
        head.extend_from_slice(&MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut head, v, target)?;
        }
        let mut slots = Vec::with_capacity(tensors.len());
        let mut rel = 0u64;
        for d in tensors {
            if d.dims.is_empty() || d.dims.len() > 4 {
                return Err(bad(format!(
                    "tensor {} has {} dims (1..=4)",
                    d.name,
                    d.dims.len()
                )));
            }
            let row = d.ty.row_bytes(d.dims[0]).ok_or_else(|| {
                bad(format!(
                    "tensor {}: row length {} is not a multiple of the {} block",
                    d.name, d.dims[0], d.ty
                ))
            })?;
            let nbytes = row * d.dims[1..].iter().product::<u64>();
            put_str(&mut head, &d.name);
            head.extend_from_slice(&(d.dims.len() as u32).to_le_bytes());
            for x in &d.dims {
                head.extend_from_slice(&x.to_le_bytes());
            }
            head.extend_from_slice(&d.ty.id().to_le_bytes());
            head.extend_from_slice(&rel.to_le_bytes());
            slots.push(Slot {
                decl: d,
                nbytes,
                rel,
            });
            rel = align_up(rel + nbytes, alignment);
        }
        let data_start = align_up(head.len() as u64, alignment);
        head.resize(data_start as usize, 0);

        check_gguf_target(target, overwrite)?;
        let tmp = slipstream_outpath::temp_path(target).map_err(|e| io(target, e))?;
        slipstream_outpath::clean_stale_temps(target, &is_gguf_leftover)
            .map_err(|e| io(target, e))?;
        let file = File::create(&tmp).map_err(|e| io(&tmp, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&head).map_err(|e| io(&tmp, e))?;
        Ok(GgufWriter {
            target: target.to_path_buf(),
            overwrite,
            tmp,
            out,
            slots,
            cur: 0,
            cur_done: 0,
            data_pos: 0,
            finished: false,
        })
    }

    /// Name of the tensor the next [`GgufWriter::write`] belongs to, if any.
    pub fn current(&self) -> Option<&TensorDecl> {
        self.slots.get(self.cur).map(|s| &s.decl)
    }

    /// Appends bytes of the current tensor (a tensor may be written in any
    /// number of pieces; it is complete once its size is reached).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let mut bytes = bytes;
        while !bytes.is_empty() {
            let Some(slot) = self.slots.get(self.cur) else {
                return Err(GgufError::Invalid {
                    path: self.target.display().to_string(),
                    what: format!("{} bytes written after the last tensor", bytes.len()),
                });
            };
            if self.cur_done == 0 && self.data_pos < slot.rel {
                let pad = (slot.rel - self.data_pos) as usize;
                self.out
                    .write_all(&vec![0u8; pad])
                    .map_err(|e| io(&self.tmp, e))?;
                self.data_pos = slot.rel;
            }
            let left = slot.nbytes - self.cur_done;
            let n = (bytes.len() as u64).min(left) as usize;
            self.out
                .write_all(&bytes[..n])
                .map_err(|e| io(&self.tmp, e))?;
            self.cur_done += n as u64;
            self.data_pos += n as u64;
            bytes = &bytes[n..];
            if self.cur_done == slot.nbytes {
                self.cur += 1;
                self.cur_done = 0;
                // Zero-byte tensors complete immediately.
                while self.slots.get(self.cur).is_some_and(|s| s.nbytes == 0) {
                    self.cur += 1;
                }
            }
        }
        Ok(())
    }

    /// Writes the whole of tensor `name`, which must be the current one.
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let bad = |what: String| GgufError::Invalid {
            path: self.target.display().to_string(),
            what,
        };
        let Some(slot) = self.slots.get(self.cur) else {
            return Err(bad(format!("tensor {name} written after the last tensor")));
        };
        if slot.decl.name != name || self.cur_done != 0 {
            return Err(bad(format!(
                "tensor {name} written out of order (expected {})",
                slot.decl.name
            )));
        }
        if slot.nbytes != bytes.len() as u64 {
            return Err(bad(format!(
                "tensor {name}: {} bytes, its declaration needs {}",
                bytes.len(),
                slot.nbytes
            )));
        }
        self.write(bytes)
    }

    /// Checks that every tensor was written, syncs and renames into place.
    /// Returns the file size.
    pub fn finish(mut self) -> Result<u64> {
        while self.slots.get(self.cur).is_some_and(|s| s.nbytes == 0) {
            self.cur += 1;
        }
        if let Some(s) = self.slots.get(self.cur) {
            return Err(GgufError::Invalid {
                path: self.target.display().to_string(),
                what: format!(
                    "tensor {} has {} of {} bytes written",
                    s.decl.name, self.cur_done, s.nbytes
                ),
            });
        }
        self.out.flush().map_err(|e| io(&self.tmp, e))?;
        let file = self.out.get_ref();
        file.sync_all().map_err(|e| io(&self.tmp, e))?;
        let size = file.metadata().map_err(|e| io(&self.tmp, e))?.len();
        check_gguf_target(&self.target, self.overwrite)?;
        slipstream_outpath::replace(&self.tmp, &self.target).map_err(|e| io(&self.target, e))?;
        self.finished = true;
        Ok(size)
    }
}

impl Drop for GgufWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}
