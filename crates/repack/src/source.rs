//! A checkpoint directory's safetensors files, memory-mapped, tensor by name.
//!
//! Nothing is read up front but the headers: tensor bytes are borrowed from
//! the mappings while they are converted, so a checkpoint far larger than RAM
//! streams through the page cache.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::{RepackError, Result};

/// One tensor of the checkpoint, borrowed from its mapping.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SrcTensor<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Offset of the data region (8 + header length).
    data_start: usize,
}

struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// All safetensors files of a checkpoint directory.
pub(crate) struct Checkpoint {
    pub dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
}

fn io_err(path: &Path, source: std::io::Error) -> RepackError {
    RepackError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` (sharded), else `model.safetensors`,
    /// else every `*.safetensors` file of `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut files: Vec<PathBuf> = Vec::new();
        let mut weight_map: Option<HashMap<String, String>> = None;
        if index_path.is_file() {
            let index = crate::config::read_json(&index_path)?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| RepackError::Corrupt {
                    path: index_path.display().to_string(),
                    reason: "no \"weight_map\" object".into(),
                })?;
            let mut wm = HashMap::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| RepackError::Corrupt {
                    path: index_path.display().to_string(),
                    reason: format!("weight_map entry for {name} is not a file name"),
                })?;
                if !files
                    .iter()
                    .any(|f| f.file_name().is_some_and(|n| n == file))
                {
                    files.push(dir.join(file));
                }
                wm.insert(name.clone(), file.to_string());
            }
            files.sort();
            weight_map = Some(wm);
        } else if single.is_file() {
            files.push(single);
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
            for entry in rd {
                let path = entry.map_err(|e| io_err(dir, e))?.path();
                if path.extension().is_some_and(|e| e == "safetensors") {
                    files.push(path);
                }
            }
            files.sort();
        }
        if files.is_empty() {
            return Err(RepackError::MissingFile {
                path: dir.display().to_string(),
                what: "model.safetensors, model.safetensors.index.json or any *.safetensors file"
                    .into(),
            });
        }

        let mut shards = Vec::new();
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    RepackError::MissingFile {
                        path: path.display().to_string(),
                        what: "a shard named in model.safetensors.index.json".into(),
                    }
                } else {
                    io_err(path, e)
                }
            })?;
            // SAFETY: the mapping is read-only and the checkpoint is not
            // expected to change while we convert it; a concurrent writer
            // could at worst corrupt the output, which the checksums expose.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
            let _ = mmap.advise(memmap2::Advice::Sequential);
            let (n, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| RepackError::Corrupt {
                    path: path.display().to_string(),
                    reason: format!("not a valid safetensors file (truncated or corrupt): {e}"),
                })?;
            for (name, info) in meta.tensors() {
                let (start, end) = info.data_offsets;
                if let Some(prev) = tensors.get(&name) {
                    return Err(RepackError::Corrupt {
                        path: path.display().to_string(),
                        reason: format!(
                            "tensor {name} also appears in {}",
                            files[prev.shard].display()
                        ),
                    });
                }
                tensors.insert(
                    name,
                    Entry {
                        shard: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start,
                        end,
                    },
                );
            }
            shards.push(Shard {
                path: path.clone(),
                mmap,
                data_start: 8 + n,
            });
        }
        if let Some(wm) = weight_map {
            for (name, file) in &wm {
                match tensors.get(name) {
                    None => {
                        return Err(RepackError::Corrupt {
                            path: dir.join(file).display().to_string(),
                            reason: format!(
                                "tensor {name} is listed in model.safetensors.index.json but not in the file"
                            ),
                        })
                    }
                    Some(e) if shards[e.shard].path.file_name().is_none_or(|n| n != file.as_str()) => {
                        return Err(RepackError::Corrupt {
                            path: index_path.display().to_string(),
                            reason: format!(
                                "tensor {name} is mapped to {file} but found in {}",
                                shards[e.shard].path.display()
                            ),
                        })
                    }
                    _ => {}
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            tensors,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    pub fn get(&self, name: &str) -> Option<SrcTensor<'_>> {
        let e = self.tensors.get(name)?;
        let shard = &self.shards[e.shard];
        let data = &shard.mmap[shard.data_start + e.start..shard.data_start + e.end];
        Some(SrcTensor {
            dtype: e.dtype,
            shape: &e.shape,
            data,
        })
    }

    /// The tensor, or an error naming it.
    pub fn require(&self, name: &str) -> Result<SrcTensor<'_>> {
        self.get(name).ok_or_else(|| RepackError::MissingTensor {
            name: name.to_string(),
            dir: self.dir.display().to_string(),
        })
    }
}
