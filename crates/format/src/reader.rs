//! Opening a `.slip` model: manifest checks, mapped dense weights, verified
//! expert record reads.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use slipstream_core::{BoxError, ExpertWeights, SharedBytes, Tensor, TensorSource, TensorView};

use crate::manifest::*;
use crate::{checksum, FormatError, Result, DENSE_FILE, EXPERTS_FILE, MANIFEST_FILE};

/// An opened model: manifest, mapped dense weights, expert pool file.
///
/// Two forms: a `.slip` directory ([`SlipModel::open`]), or a model read in
/// place from another container ([`SlipModel::in_place`], a GGUF file):
/// the same manifest, dense tensors mapped from that file (or converted at
/// open), each expert's parts read from its three stacked tensors.
pub struct SlipModel {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// `dense.bin`, or the whole in-place file.
    dense: Arc<Mmap>,
    /// `experts.bin`, or the in-place file.
    experts_path: PathBuf,
    experts: File,
    expert_checksums: Vec<Vec<u64>>,
    in_place: Option<InPlaceParts>,
}

/// Where one expert part of every expert of a layer lies in an in-place
/// file: expert `e`'s bytes are `offset + e * nbytes .. + nbytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackedPart {
    pub offset: u64,
    pub nbytes: u64,
}

/// A model read in place from a file another program wrote (a llama.cpp
/// GGUF), as its importer describes it. `manifest.dense[i].offset` is the
/// tensor's byte offset in `path` unless the tensor is in `converted`
/// (rewritten at open, e.g. rows permuted); `manifest.experts` gives the
/// record layout repack would write (parts, checksums of those records);
/// `stacked[layer][part]` where each part's bytes lie in `path`.
pub struct InPlaceModel {
    pub path: PathBuf,
    pub manifest: Manifest,
    pub converted: HashMap<String, Vec<u8>>,
    pub stacked: Vec<[StackedPart; 3]>,
    /// Side files served by [`SlipModel::read_file`] (the tokenizer).
    pub files: BTreeMap<String, Vec<u8>>,
}

struct InPlaceParts {
    converted: HashMap<String, Arc<Vec<u8>>>,
    stacked: Vec<[StackedPart; 3]>,
    files: BTreeMap<String, Vec<u8>>,
    /// Byte offset of each part's region in an expert slot (each region
    /// holds the part's page-aligned read).
    regions: [usize; 3],
    slot_bytes: usize,
    file_len: u64,
}

/// One read of an expert into its slot: `len` bytes (a multiple of 4096)
/// at file offset `offset` (a multiple of 4096) into the slot at `dest` (a
/// multiple of 4096). Only the first `need` bytes must arrive: the read may
/// stop short at the end of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertRead {
    pub offset: u64,
    pub len: usize,
    pub dest: usize,
    pub need: usize,
}

const PAGE: u64 = crate::RECORD_ALIGN as u64;

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
        if version != FORMAT_VERSION && version != FORMAT_VERSION_LAYER_PARTS {
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
        if manifest.experts.layer_parts.is_empty() != (version == FORMAT_VERSION) {
            return Err(bad(format!(
                "format version {version} with{} per-layer expert parts",
                if manifest.experts.layer_parts.is_empty() {
                    "out"
                } else {
                    ""
                }
            )));
        }
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
            || (0..pool.num_layers).any(|l| {
                pool.parts_of(l).iter().any(|p| {
                    p.offset
                        .checked_add(p.nbytes)
                        .is_none_or(|end| end > pool.record_bytes)
                })
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
            in_place: None,
        })
    }

    /// Opens a model described by an importer over a file it reads in
    /// place. Checks the manifest as [`SlipModel::open`] does, that every
    /// stacked part lies inside the file with the record's part sizes, and
    /// every dense checksum (the table the importer gives was built from the
    /// file once; a file changed since fails here or at the expert's read).
    pub fn in_place(m: InPlaceModel) -> Result<Self> {
        let InPlaceModel {
            path,
            mut manifest,
            converted,
            stacked,
            files,
        } = m;
        let p = path.display().to_string();
        let bad = |reason: String| FormatError::BadManifest {
            path: p.clone(),
            reason,
        };
        manifest.model_hash = manifest.content_hash();
        manifest.manifest_checksum = manifest.self_checksum();
        manifest
            .config
            .validate()
            .map_err(|e| bad(format!("config: {e}")))?;
        check_pool_against_config(&manifest).map_err(&bad)?;
        let file = crate::open_regular(&path, u64::MAX)?;
        let file_len = file
            .metadata()
            .map_err(|e| FormatError::io(&path, e))?
            .len();
        // SAFETY: read-only mapping of a file opened read-only; like every
        // mapped model file it must not be truncated while mapped (the
        // checksum table notices a file changed between runs).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(&path, e))?;
        let pool = &manifest.experts;
        if pool.checksums.len() != pool.num_layers
            || pool.checksums.iter().any(|r| r.len() != pool.num_experts)
            || stacked.len() != pool.num_layers
        {
            return Err(bad("expert checksum table does not match the pool".into()));
        }
        let mut regions = [0usize; 3];
        let mut slot_bytes = 0usize;
        for k in 0..3 {
            regions[k] = slot_bytes;
            let most = stacked.iter().map(|s| s[k].nbytes).max().unwrap_or(0);
            slot_bytes += (most.div_ceil(PAGE) * PAGE + PAGE) as usize;
        }
        for (l, parts) in stacked.iter().enumerate() {
            for (k, s) in parts.iter().enumerate() {
                let want = pool.parts_of(l).get(k).map(|p| p.nbytes);
                let end = s
                    .nbytes
                    .checked_mul(pool.num_experts as u64)
                    .and_then(|n| n.checked_add(s.offset));
                if want != Some(s.nbytes) || end.is_none_or(|e| e > file_len) {
                    return Err(bad(format!(
                        "expert part {k} of layer {l} does not lie inside the file with its record size"
                    )));
                }
            }
        }
        let expert_checksums = pool
            .checksums
            .iter()
            .map(|row| row.iter().map(|c| parse_hex(&path, c)).collect())
            .collect::<Result<Vec<Vec<u64>>>>()?;
        let converted: HashMap<String, Arc<Vec<u8>>> = converted
            .into_iter()
            .map(|(k, v)| (k, Arc::new(v)))
            .collect();
        let mut dense_bytes = 0u64;
        for entry in &manifest.dense {
            let bytes: &[u8] = match converted.get(&entry.name) {
                Some(b) => b,
                None => {
                    let end = entry.offset.checked_add(entry.nbytes);
                    if end.is_none_or(|end| end > map.len() as u64) {
                        return Err(bad(format!("tensor {} lies outside the file", entry.name)));
                    }
                    &map[entry.offset as usize..(entry.offset + entry.nbytes) as usize]
                }
            };
            if entry
                .qtype
                .checked_nbytes(entry.shape[0], entry.shape[1])
                .map(|n| n as u64)
                != Some(entry.nbytes)
                || bytes.len() as u64 != entry.nbytes
            {
                return Err(bad(format!("tensor {} has an invalid extent", entry.name)));
            }
            if checksum(bytes) != parse_hex(&path, &entry.checksum)? {
                return Err(FormatError::DenseChecksum {
                    path: p.clone(),
                    name: entry.name.clone(),
                });
            }
            dense_bytes += entry.nbytes;
        }
        manifest.dense_file_bytes = dense_bytes;
        manifest.experts.record_stride = slot_bytes as u64;
        // Stride and dense size are this run's, not content: re-seal.
        manifest.manifest_checksum = manifest.self_checksum();
        Ok(SlipModel {
            dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            manifest,
            dense: Arc::new(map),
            experts_path: path,
            experts: file,
            expert_checksums,
            in_place: Some(InPlaceParts {
                converted,
                stacked,
                files,
                regions,
                slot_bytes,
                file_len,
            }),
        })
    }

    /// Whether this model is read in place from another program's file.
    pub fn is_in_place(&self) -> bool {
        self.in_place.is_some()
    }

    /// Bytes of memory one expert takes when read with
    /// [`SlipModel::expert_reads`]: a multiple of 4096.
    pub fn expert_slot_bytes(&self) -> usize {
        match &self.in_place {
            Some(ip) => ip.slot_bytes,
            None => self.manifest.experts.record_stride as usize,
        }
    }

    /// Bytes of the buffer [`SlipModel::read_expert`] fills: the largest
    /// record of a `.slip` pool, the slot size in place.
    pub fn expert_buf_bytes(&self) -> usize {
        match &self.in_place {
            Some(ip) => ip.slot_bytes,
            None => self.manifest.experts.record_bytes as usize,
        }
    }

    /// The page-aligned reads that bring expert `expert` of `layer` into a
    /// page-aligned slot of [`SlipModel::expert_slot_bytes`]: one whole
    /// record of a `.slip` pool; in place, one per part (the aligned range
    /// around the part's bytes in its stacked tensor). Submitted together,
    /// so they overlap.
    pub fn expert_reads(&self, layer: usize, expert: usize) -> Vec<ExpertRead> {
        match &self.in_place {
            None => {
                let pool = &self.manifest.experts;
                let n = pool.record_stride as usize;
                vec![ExpertRead {
                    offset: pool.record_offset(layer, expert),
                    len: n,
                    dest: 0,
                    need: n,
                }]
            }
            Some(ip) => (0..3)
                .map(|k| {
                    let s = ip.stacked[layer][k];
                    let start = s.offset + expert as u64 * s.nbytes;
                    let at = start / PAGE * PAGE;
                    let end = (start + s.nbytes).div_ceil(PAGE) * PAGE;
                    ExpertRead {
                        offset: at,
                        len: (end - at) as usize,
                        dest: ip.regions[k],
                        need: (start + s.nbytes).min(ip.file_len).saturating_sub(at) as usize,
                    }
                })
                .collect(),
        }
    }

    /// Where each part of an expert lies in its slot (or resident buffer):
    /// `(offset, nbytes)` for gate, up, down.
    fn part_ranges(&self, layer: usize, expert: usize) -> Result<Vec<(usize, usize)>> {
        let pool = &self.manifest.experts;
        if layer >= pool.num_layers || expert >= pool.num_experts {
            return Err(FormatError::Invalid(format!(
                "expert {expert} of layer {layer} is outside the pool"
            )));
        }
        Ok(match &self.in_place {
            None => pool
                .parts_of(layer)
                .iter()
                .map(|p| (p.offset as usize, p.nbytes as usize))
                .collect(),
            Some(ip) => (0..3)
                .map(|k| {
                    let s = ip.stacked[layer][k];
                    let start = s.offset + expert as u64 * s.nbytes;
                    (ip.regions[k] + (start % PAGE) as usize, s.nbytes as usize)
                })
                .collect(),
        })
    }

    /// Where the dense weights are mapped: `(address, bytes of dense
    /// weights read through the map)` (for measuring how much of them is
    /// resident). In place the mapping is the whole file, of which only the
    /// dense tensors are ever touched through the map (experts are read, not
    /// mapped), and tensors converted at open live on the heap instead: they
    /// are already in the process's memory, so they are not counted here.
    pub fn dense_mapping(&self) -> (usize, usize) {
        let bytes = match &self.in_place {
            Some(ip) => {
                let converted: u64 = ip.converted.values().map(|v| v.len() as u64).sum();
                self.manifest.dense_file_bytes.saturating_sub(converted) as usize
            }
            None => self.dense.len(),
        };
        (self.dense.as_ptr() as usize, bytes)
    }

    /// A dense tensor by canonical name, sharing the mapping.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let entry = self
            .manifest
            .dense
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| FormatError::MissingTensor(name.to_string()))?;
        let converted = self.in_place.as_ref().and_then(|ip| ip.converted.get(name));
        let (bytes, offset): (SharedBytes, usize) = match converted {
            Some(b) => (b.clone(), 0),
            None => (self.dense.clone(), entry.offset as usize),
        };
        Tensor::new(
            entry.qtype,
            entry.shape[0],
            entry.shape[1],
            bytes,
            offset,
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

    /// Reads expert `expert` of `layer` into `buf` (at least
    /// [`SlipModel::expert_buf_bytes`] long) and verifies its checksum.
    pub fn read_expert(&self, layer: usize, expert: usize, buf: &mut [u8]) -> Result<()> {
        let ranges = self.part_ranges(layer, expert)?;
        let short = || FormatError::Invalid("expert buffer too short".into());
        match &self.in_place {
            None => {
                let pool = &self.manifest.experts;
                let n = pool.layer_record_bytes(layer) as usize;
                let buf = buf.get_mut(..n).ok_or_else(short)?;
                self.experts
                    .read_exact_at(buf, pool.record_offset(layer, expert))
                    .map_err(|e| FormatError::io(&self.experts_path, e))?;
            }
            Some(ip) => {
                for (k, &(at, n)) in ranges.iter().enumerate() {
                    let s = ip.stacked[layer][k];
                    let dst = buf.get_mut(at..at + n).ok_or_else(short)?;
                    self.experts
                        .read_exact_at(dst, s.offset + expert as u64 * s.nbytes)
                        .map_err(|e| FormatError::io(&self.experts_path, e))?;
                }
            }
        }
        self.verify_expert(layer, expert, buf)
    }

    /// Checks an expert read by someone else (e.g. a direct-I/O reader
    /// pool) into `record` (a slot laid out as [`SlipModel::expert_reads`]
    /// fills it, or a `.slip` record). In place, the checksum is of the
    /// record repack would have written from the same parts (parts 64-byte
    /// aligned, zeros between), so both forms share their checksums.
    pub fn verify_expert(&self, layer: usize, expert: usize, record: &[u8]) -> Result<()> {
        let bad = || FormatError::ExpertChecksum {
            path: self.experts_path.display().to_string(),
            layer,
            expert,
        };
        let want = self
            .expert_checksums
            .get(layer)
            .and_then(|r| r.get(expert))
            .copied()
            .ok_or_else(bad)?;
        let found = match &self.in_place {
            None => {
                let n = self.manifest.experts.layer_record_bytes(layer) as usize;
                checksum(record.get(..n).ok_or_else(bad)?)
            }
            Some(_) => {
                let ranges = self.part_ranges(layer, expert)?;
                let mut parts = Vec::with_capacity(3);
                for &(at, n) in &ranges {
                    parts.push(record.get(at..at + n).ok_or_else(bad)?);
                }
                record_checksum(self.manifest.experts.parts_of(layer), &parts)
            }
        };
        if found != want {
            return Err(bad());
        }
        Ok(())
    }

    /// Splits a verified expert (a record, or a slot as
    /// [`SlipModel::expert_reads`] fills it) into its parts' views (gate,
    /// up, down).
    pub fn expert_views<'a>(
        &self,
        layer: usize,
        expert: usize,
        record: &'a [u8],
    ) -> Result<ExpertWeights<'a>> {
        let ranges = self.part_ranges(layer, expert)?;
        let parts = self.manifest.experts.parts_of(layer);
        let view = |i: usize| -> Result<TensorView<'a>> {
            let (p, &(at, n)) = parts
                .get(i)
                .zip(ranges.get(i))
                .ok_or_else(|| FormatError::Invalid("expert record lacks a part".into()))?;
            let bytes = record
                .get(at..at + n)
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
        if let Some(ip) = &self.in_place {
            return ip
                .files
                .get(name)
                .cloned()
                .ok_or_else(|| FormatError::Invalid(format!("{name:?} is not in the model")));
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
    if !pool.layer_parts.is_empty() && pool.layer_parts.len() != pool.num_layers {
        return Err(format!(
            "per-layer expert parts are given for {} of {} layers",
            pool.layer_parts.len(),
            pool.num_layers
        ));
    }
    for l in 0..pool.num_layers.max(1) {
        let parts = pool.parts_of(l);
        if parts.len() != want.len() {
            return Err(format!(
                "expert records of layer {l} have {} parts, not 3",
                parts.len()
            ));
        }
        for (part, (name, shape)) in parts.iter().zip(want) {
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
    }
    Ok(())
}

/// The checksum of the record repack writes from `parts` laid out as
/// `layout` (each part at its offset, zeros between): hashed from the
/// parts where they lie, without building the record.
pub fn record_checksum(layout: &[ExpertPart], parts: &[&[u8]]) -> u64 {
    const ZEROS: [u8; 64] = [0; 64];
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut at = 0u64;
    for (p, bytes) in layout.iter().zip(parts) {
        let mut gap = p.offset.saturating_sub(at);
        while gap > 0 {
            let n = gap.min(ZEROS.len() as u64);
            h.update(&ZEROS[..n as usize]);
            gap -= n;
        }
        h.update(bytes);
        at = p.offset + bytes.len() as u64;
    }
    h.digest()
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
