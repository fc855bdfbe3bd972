//! Reading a GGUF file through a memory map.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::types::{GgmlType, Value, ValueType};
use crate::{align_up, GgufError, Result, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};

/// Most dimensions a ggml tensor has.
const MAX_DIMS: u32 = 4;
/// Nesting limit of metadata arrays (arrays of arrays).
const MAX_DEPTH: usize = 4;

/// One tensor's description.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (fastest-varying).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the first byte in the file (data section start + relative offset).
    pub offset: u64,
    /// Bytes of the tensor's data.
    pub nbytes: u64,
}

impl TensorInfo {
    /// Elements in one row (`dims[0]`).
    pub fn cols(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Rows: product of every dimension after the first.
    pub fn rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Total elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> u64 {
        self.ty.row_bytes(self.cols()).unwrap_or(0)
    }
}

/// An open, fully validated GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    pub alignment: usize,
    /// Offset of the data section.
    pub data_offset: u64,
    map: Mmap,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = (self.pos as u64).saturating_add(n);
        if end > self.bytes.len() as u64 {
            return Err(GgufError::Truncated {
                path: self.path.to_string(),
                what: what(),
                need: end,
                len: self.bytes.len() as u64,
            });
        }
        let s = &self.bytes[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::Invalid {
            path: self.path.to_string(),
            what: format!("{} is not valid UTF-8", what()),
        })
    }

    fn value(&mut self, ty: ValueType, depth: usize, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.arr::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.arr::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.arr(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.arr(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.arr(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.arr(what)?)),
            ValueType::Bool => {
                let b = self.arr::<1>(what)?[0];
                if b > 1 {
                    return Err(GgufError::Invalid {
                        path: self.path.to_string(),
                        what: format!("{}: bool value {b} (0 or 1 expected)", what()),
                    });
                }
                Value::Bool(b == 1)
            }
            ValueType::String => Value::String(self.string(what)?),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.arr(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.arr(what)?)),
            ValueType::Array => {
                if depth >= MAX_DEPTH {
                    return Err(GgufError::Invalid {
                        path: self.path.to_string(),
                        what: format!("{}: arrays nested deeper than {MAX_DEPTH}", what()),
                    });
                }
                let id = self.u32(what)?;
                let ity = ValueType::from_id(id).ok_or_else(|| GgufError::Invalid {
                    path: self.path.to_string(),
                    what: format!("{}: unknown array item type {id}", what()),
                })?;
                let n = self.u64(what)?;
                // Every item takes at least one byte: bound the allocation by the file.
                let left = (self.bytes.len() - self.pos) as u64;
                if n > left {
                    return Err(GgufError::Truncated {
                        path: self.path.to_string(),
                        what: format!("{} ({n} array items)", what()),
                        need: (self.pos as u64).saturating_add(n),
                        len: self.bytes.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(ity, depth + 1, what)?);
                }
                Value::Array { ty: ity, items }
            }
        })
    }
}

impl GgufFile {
    /// Maps and validates `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let p = path.display().to_string();
        let file = File::open(path).map_err(|e| GgufError::Io {
            path: p.clone(),
            source: e,
        })?;
        // SAFETY: the file is opened read-only and mapped read-only; like every
        // mapped model file, it must not be truncated while the map is alive
        // (a documented limit shared with the .slip reader).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::Io {
            path: p.clone(),
            source: e,
        })?;
        let len = map.len() as u64;
        if len < 4 || map[..4] != MAGIC {
            return Err(GgufError::BadMagic {
                path: p,
                found: map[..map.len().min(4)].to_vec(),
            });
        }
        let mut c = Cursor {
            bytes: &map,
            pos: 4,
            path: &p,
        };
        let version = c.u32(&|| "the header".into())?;
        if version != 2 && version != 3 {
            return Err(GgufError::Version { path: p, version });
        }
        let n_tensors = c.u64(&|| "the header".into())?;
        let n_kv = c.u64(&|| "the header".into())?;
        let mut metadata = Vec::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let what = || format!("metadata value {key}");
            let id = c.u32(&what)?;
            let ty = ValueType::from_id(id).ok_or_else(|| GgufError::Invalid {
                path: p.clone(),
                what: format!("metadata {key}: unknown value type {id}"),
            })?;
            let v = c.value(ty, 0, &what)?;
            metadata.push((key, v));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => {
                    return Err(GgufError::Invalid {
                        path: p,
                        what: format!("{ALIGNMENT_KEY} = {v:?} is not a power of two"),
                    })
                }
            },
        };
        struct Raw {
            name: String,
            dims: Vec<u64>,
            id: u32,
            rel: u64,
        }
        let mut raws = Vec::new();
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor info #{i}"))?;
            let what = || format!("tensor info {name}");
            let nd = c.u32(&what)?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(GgufError::Invalid {
                    path: p,
                    what: format!("tensor {name} has {nd} dimensions (1..={MAX_DIMS})"),
                });
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(c.u64(&what)?);
            }
            let id = c.u32(&what)?;
            let rel = c.u64(&what)?;
            raws.push(Raw {
                name,
                dims,
                id,
                rel,
            });
        }
        let data_offset = align_up(c.pos as u64, alignment as u64);
        let mut tensors = Vec::with_capacity(raws.len());
        for r in raws {
            let ty = GgmlType::from_id(r.id).ok_or_else(|| GgufError::UnknownType {
                path: p.clone(),
                name: r.name.clone(),
                id: r.id,
                ty: "not a ggml type this reader knows",
            })?;
            let bad = |what: String| GgufError::Invalid {
                path: p.clone(),
                what: format!("tensor {}: {what}", r.name),
            };
            let elems = r
                .dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("dims {:?} overflow", r.dims)))?;
            let row = ty.row_bytes(r.dims[0]).ok_or_else(|| {
                bad(format!(
                    "row length {} is not a multiple of the {} block ({})",
                    r.dims[0],
                    ty,
                    ty.block_elems()
                ))
            })?;
            let rows = elems.checked_div(r.dims[0]).unwrap_or(0);
            let nbytes = row
                .checked_mul(rows)
                .ok_or_else(|| bad("size overflows".into()))?;
            if r.rel % alignment as u64 != 0 {
                return Err(bad(format!(
                    "offset {} is not a multiple of the alignment {alignment}",
                    r.rel
                )));
            }
            let start = data_offset.saturating_add(r.rel);
            let end = start.saturating_add(nbytes);
            if end > len {
                return Err(GgufError::TensorBeyondEnd {
                    path: p.clone(),
                    name: r.name,
                    start,
                    end,
                    len,
                });
            }
            tensors.push(TensorInfo {
                name: r.name,
                dims: r.dims,
                ty,
                offset: start,
                nbytes,
            });
        }
        let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(GgufError::Invalid {
                path: p,
                what: format!("tensor {} appears twice", w[0]),
            });
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            map,
        })
    }

    /// The value of metadata `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor (bounds were checked at open).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.offset as usize..(t.offset + t.nbytes) as usize]
    }

    /// The bytes before the data section: header, metadata, tensor infos.
    pub fn header(&self) -> &[u8] {
        &self.map[..(self.data_offset as usize).min(self.map.len())]
    }

    /// Size of the file in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}
