//! Opening a `.slip` model: manifest checks, mapped dense weights, verified
//! expert record reads.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use slipstream_core::{BoxError, ExpertWeights, SharedBytes, Tensor, TensorSource, TensorView};

use crate::manifest::*;
use crate::{checksum, FormatError, Result, DENSE_FILE, EXPERTS_FILE, MANIFEST_FILE};

/// An opened model: manifest, mapped dense weights, expert pool file.
pub struct SlipModel {
    pub dir: PathBuf,
    pub manifest: Manifest,
    dense: Arc<Mmap>,
    experts_path: PathBuf,
    experts: File,
    expert_checksums: Vec<Vec<u64>>,
}

fn parse_hex(path: &Path, s: &str) -> Result<u64> {
    u64::from_str_radix(s, 16).map_err(|_| FormatError::BadManifest {
        path: path.display().to_string(),
        reason: format!("bad checksum {s:?}"),
    })
}

impl SlipModel {
    /// Opens and checks a model directory. Verifies file sizes and every
    /// dense tensor checksum; expert records are verified when read.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let text = crate::read_regular(&manifest_path, crate::MAX_MANIFEST_BYTES)?;
        let bad = |reason: String| FormatError::BadManifest {
            path: manifest_path.display().to_string(),
            reason,
        };
        let probe: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        if probe.get("format").and_then(|v| v.as_str()) != Some(FORMAT_NAME) {
            return Err(bad("missing \"format\": \"slipstream\"".into()));
        }
        let version = probe.get("version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
        if version != FORMAT_VERSION {
            return Err(FormatError::Version {
                path: manifest_path.display().to_string(),
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let manifest: Manifest = serde_json::from_value(probe).map_err(|e| bad(format!("{e}")))?;
        if manifest.manifest_checksum != manifest.self_checksum() {
            return Err(bad(
                "its checksum does not match its content: the manifest was edited or corrupted (repack the model)"
                    .into(),
            ));
        }
        if manifest.model_hash != manifest.content_hash() {
            return Err(bad(format!(
                "model_hash {} is not the hash of the model's content",
                manifest.model_hash
            )));
        }
        manifest
            .config
            .validate()
            .map_err(|e| bad(format!("config: {e}")))?;
        check_pool_against_config(&manifest).map_err(bad)?;
        if let Some(name) = &manifest.tokenizer {
            if !crate::files::is_plain_file_name(name) {
                return Err(bad(format!(
                    "tokenizer {name:?} is not a file name inside the model directory"
                )));
            }
        }
        let pool = &manifest.experts;
        if pool.checksums.len() != pool.num_layers
            || pool.checksums.iter().any(|r| r.len() != pool.num_experts)
        {
            return Err(bad("expert checksum table does not match the pool".into()));
        }
        if !pool
            .record_stride
            .is_multiple_of(crate::RECORD_ALIGN as u64)
            || pool.record_bytes > pool.record_stride
            || pool.parts.iter().any(|p| {
                p.offset
                    .checked_add(p.nbytes)
                    .is_none_or(|end| end > pool.record_bytes)
            })
        {
            return Err(bad("expert record layout is inconsistent".into()));
        }
        // The pool's size in bytes must be a number (`file_bytes`,
        // `record_offset` multiply by the stride).
        if ((pool.num_layers * pool.num_experts) as u64)
            .checked_mul(pool.record_stride)
            .is_none()
        {
            return Err(bad(format!(
                "expert record stride {} makes the pool larger than any file",
                pool.record_stride
            )));
        }
        let expert_checksums = pool
            .checksums
            .iter()
            .map(|row| row.iter().map(|c| parse_hex(&manifest_path, c)).collect())
            .collect::<Result<Vec<Vec<u64>>>>()?;

        let dense_path = dir.join(DENSE_FILE);
        let dense_file = crate::open_regular(&dense_path, u64::MAX)?;
        check_size(&dense_path, &dense_file, manifest.dense_file_bytes)?;
        // SAFETY: the file is opened read-only and slipstream never writes a
        // model in place (writers build a new directory and rename it), so the
        // mapping is not mutated underneath us by this program.
        let dense =
            unsafe { Mmap::map(&dense_file) }.map_err(|e| FormatError::io(&dense_path, e))?;
        for entry in &manifest.dense {
            let end = entry.offset.checked_add(entry.nbytes);
            if end.is_none_or(|end| end > dense.len() as u64)
                || entry
                    .qtype
                    .checked_nbytes(entry.shape[0], entry.shape[1])
                    .map(|n| n as u64)
                    != Some(entry.nbytes)
                || entry.offset % crate::DENSE_ALIGN as u64 != 0
            {
                return Err(bad(format!("tensor {} has an invalid extent", entry.name)));
            }
            let bytes = &dense[entry.offset as usize..(entry.offset + entry.nbytes) as usize];
            if checksum(bytes) != parse_hex(&manifest_path, &entry.checksum)? {
                return Err(FormatError::DenseChecksum {
                    path: dense_path.display().to_string(),
                    name: entry.name.clone(),
                });
            }
        }

        let experts_path = dir.join(EXPERTS_FILE);
        let experts = crate::open_regular(&experts_path, u64::MAX)?;
        check_size(&experts_path, &experts, pool.file_bytes())?;
        Ok(SlipModel {
            dir: dir.to_path_buf(),
            manifest,
            dense: Arc::new(dense),
            experts_path,
            experts,
            expert_checksums,
        })
    }

    /// Where the dense weights are mapped: `(address, bytes)` (for
    /// measuring how much of the mapping is resident).
    pub fn dense_mapping(&self) -> (usize, usize) {
        (self.dense.as_ptr() as usize, self.dense.len())
    }

    /// A dense tensor by canonical name, sharing the mapping.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let entry = self
            .manifest
            .dense
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| FormatError::MissingTensor(name.to_string()))?;
        let bytes: SharedBytes = self.dense.clone();
        Tensor::new(
            entry.qtype,
            entry.shape[0],
            entry.shape[1],
            bytes,
            entry.offset as usize,
            entry.nbytes as usize,
        )
        .map_err(|e| FormatError::Invalid(format!("tensor {name}: {e}")))
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.manifest.dense.iter().any(|e| e.name == name)
    }

    /// Path of the expert pool file (readers may open it with their own flags).
    pub fn experts_path(&self) -> &Path {
        &self.experts_path
    }

    /// Reads expert `expert` of `layer` into `buf` (at least `record_bytes`
    /// long) and verifies its checksum.
    pub fn read_expert(&self, layer: usize, expert: usize, buf: &mut [u8]) -> Result<()> {
        let pool = &self.manifest.experts;
        if layer >= pool.num_layers || expert >= pool.num_experts {
            return Err(FormatError::Invalid(format!(
                "expert {expert} of layer {layer} is outside the pool"
            )));
        }
        let n = pool.record_bytes as usize;
        let buf = &mut buf[..n];
        self.experts
            .read_exact_at(buf, pool.record_offset(layer, expert))
            .map_err(|e| FormatError::io(&self.experts_path, e))?;
        self.verify_expert(layer, expert, buf)
    }

    /// Checks a record read by someone else (e.g. a direct-I/O reader pool).
    pub fn verify_expert(&self, layer: usize, expert: usize, record: &[u8]) -> Result<()> {
        let n = self.manifest.experts.record_bytes as usize;
        if record.len() < n || checksum(&record[..n]) != self.expert_checksums[layer][expert] {
            return Err(FormatError::ExpertChecksum {
                path: self.experts_path.display().to_string(),
                layer,
                expert,
            });
        }
        Ok(())
    }

    /// Splits a verified record into its parts' views (gate, up, down).
    pub fn expert_views<'a>(&self, record: &'a [u8]) -> Result<ExpertWeights<'a>> {
        let parts = &self.manifest.experts.parts;
        let view = |i: usize| -> Result<TensorView<'a>> {
            let p = parts
                .get(i)
                .ok_or_else(|| FormatError::Invalid("expert record lacks a part".into()))?;
            let bytes = record
                .get(p.offset as usize..(p.offset + p.nbytes) as usize)
                .ok_or_else(|| FormatError::Invalid("expert record too short".into()))?;
            TensorView::new(p.qtype, p.shape[0], p.shape[1], bytes)
                .map_err(|e| FormatError::Invalid(format!("expert {}: {e}", p.name)))
        };
        Ok(ExpertWeights {
            gate: view(0)?,
            up: view(1)?,
            down: view(2)?,
        })
    }

    /// Contents of a file stored beside the manifest (the tokenizer).
    /// Reads a side file of the model directory (the tokenizer): a plain
    /// name, a regular file of bounded size.
    pub fn read_file(&self, name: &str) -> Result<Vec<u8>> {
        if !crate::files::is_plain_file_name(name) {
            return Err(FormatError::Invalid(format!(
                "{name:?} is not a file name inside the model directory"
            )));
        }
        crate::read_regular(&self.dir.join(name), crate::MAX_SIDE_FILE_BYTES)
    }
}

/// The expert pool must be the one the config describes: a layer's routed
/// experts are read from it by index and multiplied with shapes from the
/// config, so any disagreement is an open-time error, never a panic later.
fn check_pool_against_config(m: &Manifest) -> std::result::Result<(), String> {
    let (c, pool) = (&m.config, &m.experts);
    // MTP layers keep their routed experts in the pool after the main ones.
    if pool.num_layers != c.total_layers() || pool.num_experts != c.num_experts {
        return Err(format!(
            "the expert pool has {} layers of {} experts, the config {} of {}",
            pool.num_layers,
            pool.num_experts,
            c.total_layers(),
            c.num_experts
        ));
    }
    let (h, i) = (c.hidden_size, c.moe_intermediate_size);
    let want = [("gate", [i, h]), ("up", [i, h]), ("down", [h, i])];
    if pool.parts.len() != want.len() {
        return Err(format!(
            "expert records have {} parts, not 3",
            pool.parts.len()
        ));
    }
    for (part, (name, shape)) in pool.parts.iter().zip(want) {
        if part.name != name || part.shape != shape {
            return Err(format!(
                "expert part {} {:?} does not match the config's {name} {shape:?}",
                part.name, part.shape
            ));
        }
        part.qtype
            .check_cols(shape[1])
            .map_err(|e| format!("expert part {name}: {e}"))?;
        if part
            .qtype
            .checked_nbytes(shape[0], shape[1])
            .map(|n| n as u64)
            != Some(part.nbytes)
        {
            return Err(format!(
                "expert part {name}: {} bytes do not fit {} {shape:?}",
                part.nbytes,
                part.qtype.name()
            ));
        }
    }
    Ok(())
}

fn check_size(path: &Path, file: &File, expected: u64) -> Result<()> {
    let found = file.metadata().map_err(|e| FormatError::io(path, e))?.len();
    if found != expected {
        return Err(FormatError::Size {
            path: path.display().to_string(),
            expected,
            found,
        });
    }
    Ok(())
}

impl TensorSource for SlipModel {
    fn tensor(&self, name: &str) -> std::result::Result<Tensor, BoxError> {
        SlipModel::tensor(self, name).map_err(Into::into)
    }
    fn has_tensor(&self, name: &str) -> bool {
        SlipModel::has_tensor(self, name)
    }
}
