//! Writing a `.slip` model atomically: everything goes to a temporary
//! directory beside the target, is fsynced, and is renamed into place last.

use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use slipstream_core::{ModelConfig, QuantType};
use slipstream_outpath::Overwrite;

use crate::manifest::*;
use crate::target::{check_model_target, holds_only_model_files};
use crate::{
    align_up, checksum, FormatError, Result, DENSE_ALIGN, DENSE_FILE, EXPERTS_FILE, MANIFEST_FILE,
    RECORD_ALIGN,
};

/// Shape and type of the three projections of every expert.
#[derive(Debug, Clone)]
pub struct ExpertPoolLayout {
    pub num_layers: usize,
    pub num_experts: usize,
    /// `(name, qtype, [rows, cols])` for gate, up, down in record order.
    pub parts: Vec<(String, QuantType, [usize; 2])>,
    /// `layer_qtypes[layer][part]`: the part types of each layer when they
    /// differ between layers (else empty: every layer has `parts`' types).
    pub layer_qtypes: Vec<Vec<QuantType>>,
}

impl ExpertPoolLayout {
    /// The pool index a writer starts from: part offsets (64-byte aligned
    /// in the record), per-layer parts when types differ, record size and
    /// stride; checksums empty.
    pub fn index(&self) -> Result<ExpertPoolIndex> {
        let parts = record_parts(&self.parts, self.parts.iter().map(|p| p.1))?;
        let mixed = self
            .layer_qtypes
            .iter()
            .any(|q| q.len() != parts.len() || q.iter().zip(&parts).any(|(a, p)| *a != p.qtype));
        let layer_parts = if mixed {
            if self.layer_qtypes.len() != self.num_layers
                || self.layer_qtypes.iter().any(|q| q.len() != parts.len())
            {
                return Err(FormatError::Invalid(format!(
                    "expert part types given for {} layers, the pool has {} layers of {} parts",
                    self.layer_qtypes.len(),
                    self.num_layers,
                    parts.len()
                )));
            }
            self.layer_qtypes
                .iter()
                .map(|q| record_parts(&self.parts, q.iter().copied()))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let end = |ps: &[ExpertPart]| ps.last().map(|p| p.offset + p.nbytes).unwrap_or(0);
        let record_bytes = layer_parts
            .iter()
            .map(|ps| end(ps))
            .max()
            .unwrap_or(0)
            .max(end(&parts));
        let record_stride = align_up(record_bytes.max(1) as usize, RECORD_ALIGN) as u64;
        Ok(ExpertPoolIndex {
            num_layers: self.num_layers,
            num_experts: self.num_experts,
            record_bytes,
            record_stride,
            parts,
            layer_parts,
            checksums: vec![vec![String::new(); self.num_experts]; self.num_layers],
        })
    }
}

/// Parts of one record: each 64-byte aligned inside it, for the kernels.
fn record_parts(
    parts: &[(String, QuantType, [usize; 2])],
    qtypes: impl Iterator<Item = QuantType>,
) -> Result<Vec<ExpertPart>> {
    let mut out = Vec::new();
    let mut off = 0u64;
    for ((name, _, [rows, cols]), qtype) in parts.iter().zip(qtypes) {
        qtype
            .check_cols(*cols)
            .map_err(|e| FormatError::Invalid(format!("expert {name}: {e}")))?;
        let nbytes = qtype.nbytes(*rows, *cols) as u64;
        out.push(ExpertPart {
            name: name.clone(),
            qtype,
            shape: [*rows, *cols],
            offset: off,
            nbytes,
        });
        off = align_up((off + nbytes) as usize, DENSE_ALIGN) as u64;
    }
    Ok(out)
}

/// Builds a `.slip` directory. Nothing appears at the target path until
/// [`SlipWriter::finish`] succeeds; dropping the writer removes the temp dir.
pub struct SlipWriter {
    target: PathBuf,
    overwrite: Overwrite,
    tmp: PathBuf,
    dense: BufWriter<File>,
    dense_pos: u64,
    dense_entries: Vec<DenseEntry>,
    experts: File,
    pool: ExpertPoolIndex,
    written: Vec<Vec<bool>>,
    finished: bool,
}

fn hex(v: u64) -> String {
    format!("{v:016x}")
}

impl SlipWriter {
    /// Starts a model at `target` with the given expert pool layout.
    /// Refuses, before writing anything, a target that is not a slipstream
    /// model (or, with [`Overwrite::Force`], a damaged one); removes what
    /// dead writers of the same target left beside it.
    pub fn create(target: &Path, layout: ExpertPoolLayout, overwrite: Overwrite) -> Result<Self> {
        check_model_target(target, overwrite)?;
        let tmp = slipstream_outpath::temp_path(target).map_err(|e| FormatError::io(target, e))?;
        let parent = tmp.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::create_dir_all(&parent).map_err(|e| FormatError::io(&parent, e))?;
        let cleaned = slipstream_outpath::clean_stale_temps(target, &holds_only_model_files)
            .map_err(|e| FormatError::io(target, e))?;
        for line in cleaned {
            tracing::warn!("{line}");
        }
        // A crash of this process, and then a new one with the same pid,
        // may have left our own name behind.
        if tmp.exists() && holds_only_model_files(&tmp) {
            fs::remove_dir_all(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        }
        fs::create_dir(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        let dense_path = tmp.join(DENSE_FILE);
        let dense = File::create(&dense_path).map_err(|e| FormatError::io(&dense_path, e))?;
        let experts_path = tmp.join(EXPERTS_FILE);
        let experts = File::create(&experts_path).map_err(|e| FormatError::io(&experts_path, e))?;

        let pool = layout.index()?;
        experts
            .set_len(pool.file_bytes())
            .map_err(|e| FormatError::io(&experts_path, e))?;
        Ok(SlipWriter {
            target: target.to_path_buf(),
            overwrite,
            tmp,
            dense: BufWriter::with_capacity(1 << 22, dense),
            dense_pos: 0,
            dense_entries: Vec::new(),
            experts,
            written: vec![vec![false; layout.num_experts]; layout.num_layers],
            pool,
            finished: false,
        })
    }

    /// The record layout chosen for the pool (part offsets, record size).
    pub fn pool(&self) -> &ExpertPoolIndex {
        &self.pool
    }

    /// Appends a dense tensor. `bytes` must match `qtype` and `shape`.
    pub fn add_dense(
        &mut self,
        name: &str,
        qtype: QuantType,
        shape: [usize; 2],
        bytes: &[u8],
    ) -> Result<()> {
        if bytes.len() != qtype.nbytes(shape[0], shape[1]) {
            return Err(FormatError::Invalid(format!(
                "tensor {name}: {} bytes do not fit {} {:?}",
                bytes.len(),
                qtype.name(),
                shape
            )));
        }
        if self.dense_entries.iter().any(|e| e.name == name) {
            return Err(FormatError::Invalid(format!("tensor {name} written twice")));
        }
        let start = align_up(self.dense_pos as usize, DENSE_ALIGN) as u64;
        let pad = (start - self.dense_pos) as usize;
        let path = self.tmp.join(DENSE_FILE);
        self.dense
            .write_all(&[0u8; DENSE_ALIGN][..pad])
            .and_then(|_| self.dense.write_all(bytes))
            .map_err(|e| FormatError::io(&path, e))?;
        self.dense_pos = start + bytes.len() as u64;
        self.dense_entries.push(DenseEntry {
            name: name.to_string(),
            qtype,
            shape,
            offset: start,
            nbytes: bytes.len() as u64,
            checksum: hex(checksum(bytes)),
        });
        Ok(())
    }

    /// Writes one expert record; `parts` are the gate, up, down bytes in
    /// layout order. Records may be written in any order, from one thread.
    pub fn write_expert(&mut self, layer: usize, expert: usize, parts: &[&[u8]]) -> Result<()> {
        if layer >= self.pool.num_layers || expert >= self.pool.num_experts {
            return Err(FormatError::Invalid(format!(
                "expert {expert} of layer {layer} is outside the pool"
            )));
        }
        let layout = self.pool.parts_of(layer);
        if parts.len() != layout.len() {
            return Err(FormatError::Invalid("wrong number of expert parts".into()));
        }
        let mut record = vec![0u8; self.pool.layer_record_bytes(layer) as usize];
        for (bytes, part) in parts.iter().zip(layout) {
            if bytes.len() as u64 != part.nbytes {
                return Err(FormatError::Invalid(format!(
                    "expert {expert} of layer {layer}: {} has {} bytes, layout needs {}",
                    part.name,
                    bytes.len(),
                    part.nbytes
                )));
            }
            record[part.offset as usize..(part.offset + part.nbytes) as usize]
                .copy_from_slice(bytes);
        }
        let path = self.tmp.join(EXPERTS_FILE);
        self.experts
            .write_all_at(&record, self.pool.record_offset(layer, expert))
            .map_err(|e| FormatError::io(&path, e))?;
        self.pool.checksums[layer][expert] = hex(checksum(&record));
        self.written[layer][expert] = true;
        Ok(())
    }

    /// Copies a file (the tokenizer) into the model directory.
    pub fn add_file(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let path = self.tmp.join(name);
        let mut f = File::create(&path).map_err(|e| FormatError::io(&path, e))?;
        f.write_all(bytes)
            .and_then(|_| f.sync_all())
            .map_err(|e| FormatError::io(&path, e))
    }

    /// Writes the manifest, syncs everything and moves the model into place,
    /// replacing an older model at the same path: the old or the new model
    /// is at the target at every instant.
    pub fn finish(mut self, info: ManifestInfo) -> Result<Manifest> {
        for (layer, row) in self.written.iter().enumerate() {
            if let Some(expert) = row.iter().position(|w| !w) {
                return Err(FormatError::Invalid(format!(
                    "expert {expert} of layer {layer} was never written"
                )));
            }
        }
        let dense_path = self.tmp.join(DENSE_FILE);
        self.dense
            .flush()
            .map_err(|e| FormatError::io(&dense_path, e))?;
        let dense = self.dense.get_mut();
        dense
            .seek(SeekFrom::End(0))
            .and_then(|_| dense.sync_all())
            .map_err(|e| FormatError::io(&dense_path, e))?;
        let experts_path = self.tmp.join(EXPERTS_FILE);
        self.experts
            .sync_all()
            .map_err(|e| FormatError::io(&experts_path, e))?;

        let mut manifest = Manifest {
            format: FORMAT_NAME.into(),
            version: if self.pool.layer_parts.is_empty() {
                FORMAT_VERSION
            } else {
                FORMAT_VERSION_LAYER_PARTS
            },
            config: info.config,
            dense: std::mem::take(&mut self.dense_entries),
            dense_file_bytes: self.dense_pos,
            experts: self.pool.clone(),
            tokenizer: info.tokenizer,
            chat_template: info.chat_template,
            eos_token_ids: info.eos_token_ids,
            special_tokens: info.special_tokens,
            generation: info.generation.filter(|g| !g.is_empty()),
            source: info.source,
            model_hash: String::new(),
            manifest_checksum: String::new(),
        };
        manifest.model_hash = manifest.content_hash();
        manifest.manifest_checksum = manifest.self_checksum();
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| FormatError::Invalid(format!("manifest: {e}")))?;
        self.add_file(MANIFEST_FILE, &json)?;
        sync_dir(&self.tmp)?;

        // Whatever appeared at the target while we wrote gets the same check.
        check_model_target(&self.target, self.overwrite)?;
        slipstream_outpath::replace(&self.tmp, &self.target)
            .map_err(|e| FormatError::io(&self.target, e))?;
        self.finished = true;
        Ok(manifest)
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| FormatError::io(dir, e))
}

impl Drop for SlipWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Manifest fields the writer does not derive itself.
#[derive(Debug, Clone)]
pub struct ManifestInfo {
    pub config: ModelConfig,
    pub tokenizer: Option<String>,
    pub chat_template: Option<String>,
    pub eos_token_ids: Vec<u32>,
    pub special_tokens: std::collections::BTreeMap<String, String>,
    /// Recommended sampling settings (`None` or empty: none recorded).
    pub generation: Option<crate::manifest::GenerationDefaults>,
    pub source: SourceInfo,
}
