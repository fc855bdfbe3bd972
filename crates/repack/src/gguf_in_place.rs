//! Running a GGUF file in place: a [`SlipModel`] over the GGUF itself, no
//! second copy on disk (docs/GGUF_IN_PLACE.md).
//!
//! The model is the one repack would write from the same file, built from
//! the same code (`gguf_source`): the same config, dense tensors (those kept
//! as stored are mapped from the file, the few the converter changed are
//! converted at open), the same expert record layout. An expert's gate, up
//! and down are the `e`-th slabs of the layer's stacked `ffn_*_exps`
//! tensors, read in place; their bytes are what repack copies into a
//! record (it keeps ggml blocks as stored), so the kernels see the same
//! bytes and the same types, and a run is bit-identical to the repacked
//! model's by construction.
//!
//! Checksums: a `.slip` manifest carries one per dense tensor and expert
//! record; a GGUF has none. The first open hashes the file once (dense
//! tensors as the model sees them, each expert as the record repack would
//! write) into a checksum table, cached beside the file
//! (`NAME.slipstream-index.json`) or, where that directory cannot take it,
//! in the index directory given. Its checksums are repack's, so the model
//! hash is the repacked model's too. A table is used only when the file's
//! size, modification time and header (metadata and tensor infos) are
//! those it was built from; otherwise it is rebuilt. Then every dense
//! tensor is verified at open and every expert each time it is read, as
//! for a `.slip` model.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use slipstream_format::{
    checksum, record_checksum, GenerationDefaults, InPlaceModel, Manifest, SlipModel, SourceInfo,
    StackedPart, FORMAT_NAME, FORMAT_VERSION, FORMAT_VERSION_LAYER_PARTS, TOKENIZER_FILE,
};
use slipstream_gguf::GgufFile;

use crate::gguf_source::{
    check_tokenizer, dense_tensors, expert_tensors, model_config, pool_layout, tokenizer, Src,
};
use crate::{RepackError, Result};

/// Where a table is kept when it cannot be beside the file.
#[derive(Debug, Clone, Default)]
pub struct InPlaceOptions {
    /// A directory for checksum tables of GGUF files whose own directory
    /// cannot take one (read-only, or a file of another program holds the
    /// name). `None`: such a file's table is built at every open.
    pub index_dir: Option<PathBuf>,
}

/// What an open did about the checksum table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexUse {
    /// A table built earlier for this very file was used.
    Reused(PathBuf),
    /// The table was built (none, or a stale one) and saved here.
    Built(PathBuf),
    /// The table was built and could not be saved anywhere.
    BuiltUnsaved,
}

const INDEX_FORMAT: &str = "slipstream-gguf-index";
/// Bumped when what the table's checksums cover changes (the importer's
/// conversions, the record layout), so older tables are rebuilt.
const INDEX_VERSION: u32 = 1;
const INDEX_SUFFIX: &str = ".slipstream-index.json";
/// A table is small (a checksum per expert); anything larger is not ours.
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// The checksum table of one GGUF file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct IndexFile {
    format: String,
    version: u32,
    /// What it was built from: the file's size, modification time (ns
    /// since the epoch) and xxh3 of its header.
    file_bytes: u64,
    modified_ns: u64,
    header_checksum: String,
    /// `(canonical name, xxh3 of the tensor as the model sees it)`, in
    /// the model's dense order.
    dense: Vec<(String, String)>,
    /// `experts[layer][expert]`: xxh3 of the record repack would write.
    experts: Vec<Vec<String>>,
}

/// Identity of the file a table must match.
#[derive(Debug, Clone, PartialEq)]
struct FileStamp {
    bytes: u64,
    modified_ns: u64,
    header: String,
}

fn hex(v: u64) -> String {
    format!("{v:016x}")
}

fn io_err(path: &Path, source: std::io::Error) -> RepackError {
    RepackError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn stamp(path: &Path, f: &GgufFile) -> Result<FileStamp> {
    let meta = std::fs::metadata(path).map_err(|e| io_err(path, e))?;
    let modified_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    Ok(FileStamp {
        bytes: meta.len(),
        modified_ns,
        header: hex(checksum(f.header())),
    })
}

/// Where a GGUF's table may be: beside it, then in the index directory
/// (named by a hash of the file's absolute path, so two files of one name
/// do not share a table).
fn index_paths(path: &Path, opts: &InPlaceOptions) -> Vec<PathBuf> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model.gguf".into());
    let mut out = vec![path.with_file_name(format!("{name}{INDEX_SUFFIX}"))];
    if let Some(dir) = &opts.index_dir {
        let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let key = hex(checksum(abs.as_os_str().as_encoded_bytes()));
        out.push(dir.join(format!("{key}-{name}{INDEX_SUFFIX}")));
    }
    out
}

/// Reads a table; `None` when absent or not a table of ours (then the
/// file is never written over).
fn read_index(path: &Path) -> Option<IndexFile> {
    let bytes = slipstream_format::read_regular(path, MAX_INDEX_BYTES).ok()?;
    let t: IndexFile = serde_json::from_slice(&bytes).ok()?;
    (t.format == INDEX_FORMAT).then_some(t)
}

/// Whether `path` is free for our table: nothing there, or a table of ours
/// (a stale one is replaced).
fn ours_or_absent(path: &Path) -> bool {
    match std::fs::symlink_metadata(path) {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        Ok(m) => m.is_file() && read_index(path).is_some(),
    }
}

/// Writes `t` at `path` atomically (temp file beside it, fsync, rename).
fn write_index(path: &Path, t: &IndexFile) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Temps of table writers that died: removed when they start as a
    // table of ours does (anything else is left alone).
    let _ = slipstream_outpath::clean_stale_temps(path, &|p: &Path| {
        let prefix = format!("{{\"format\":\"{INDEX_FORMAT}\"");
        let mut head = vec![0u8; prefix.len()];
        std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file() && m.len() <= MAX_INDEX_BYTES)
            && File::open(p).is_ok_and(|f| f.read_exact_at(&mut head, 0).is_ok())
            && head == prefix.as_bytes()
    });
    let tmp = slipstream_outpath::temp_path(path)?;
    let json = serde_json::to_vec(t).map_err(std::io::Error::other)?;
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(&json)?;
        f.sync_all()?;
        // A table of ours (or nothing) is at `path`: checked just before.
        if !ours_or_absent(path) {
            return Err(std::io::Error::other("another file took the name"));
        }
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Opens a GGUF file as a model read in place (see the module doc).
pub fn open_gguf_in_place(path: &Path, opts: &InPlaceOptions) -> Result<SlipModel> {
    open_gguf_in_place_with(path, opts).map(|(m, _)| m)
}

/// [`open_gguf_in_place`], also telling what happened to the table.
pub fn open_gguf_in_place_with(
    path: &Path,
    opts: &InPlaceOptions,
) -> Result<(SlipModel, IndexUse)> {
    let shown = path.display().to_string();
    let f = GgufFile::open(path).map_err(|e| RepackError::Corrupt {
        path: shown.clone(),
        reason: e.to_string(),
    })?;
    let src = Src {
        f: &f,
        path: shown.clone(),
        read: Default::default(),
    };
    let cfg = model_config(&src)?;
    let tok = tokenizer(&f);
    if let Some(json) = &tok.tokenizer_json {
        check_tokenizer(json, cfg.vocab_size, &shown)?;
    }
    let exps = expert_tensors(&src, &cfg)?;
    let layout = pool_layout(&cfg, &exps);
    let mut pool = layout.index()?;
    let e_count = cfg.num_experts;
    let stacked: Vec<[StackedPart; 3]> = exps
        .iter()
        .map(|p| {
            p.map(|(t, _)| StackedPart {
                offset: t.offset,
                nbytes: t.nbytes / e_count.max(1) as u64,
            })
        })
        .collect();
    let jobs = dense_tensors(&src, &cfg)?;
    let mut dense = Vec::with_capacity(jobs.len());
    for (_, job) in &jobs {
        dense.push(job()?);
    }

    let here = stamp(path, &f)?;
    let candidates = index_paths(path, opts);
    let fits = |t: &IndexFile| {
        t.version == INDEX_VERSION
            && t.file_bytes == here.bytes
            && t.modified_ns == here.modified_ns
            && t.header_checksum == here.header
            && t.dense.len() == dense.len()
            && t.dense.iter().zip(&dense).all(|(a, d)| a.0 == d.name)
            && t.experts.len() == pool.num_layers
            && t.experts.iter().all(|r| r.len() == e_count)
    };
    let found = candidates
        .iter()
        .find_map(|p| read_index(p).filter(fits).map(|t| (t, p.clone())));
    let (table, used) = match found {
        Some((t, p)) => (t, IndexUse::Reused(p)),
        None => {
            let t = build_index(path, &here, &dense, &pool, &stacked)?;
            let saved = candidates
                .iter()
                .find(|p| ours_or_absent(p) && write_index(p, &t).is_ok())
                .cloned();
            (t, saved.map_or(IndexUse::BuiltUnsaved, IndexUse::Built))
        }
    };

    pool.checksums = table.experts;
    let mut converted = HashMap::new();
    let mut entries = Vec::with_capacity(dense.len());
    for (d, (_, sum)) in dense.into_iter().zip(table.dense) {
        let nbytes = d.bytes.len() as u64;
        let offset = match d.stored_at {
            Some(at) => at,
            None => {
                converted.insert(d.name.clone(), d.bytes.into_owned());
                0
            }
        };
        entries.push(slipstream_format::DenseEntry {
            name: d.name,
            qtype: d.qtype,
            shape: d.shape,
            offset,
            nbytes,
            checksum: sum,
        });
    }
    let mut files = BTreeMap::new();
    let tokenizer_file = tok.tokenizer_json.map(|json| {
        files.insert(TOKENIZER_FILE.to_string(), json);
        TOKENIZER_FILE.to_string()
    });
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: if pool.layer_parts.is_empty() {
            FORMAT_VERSION
        } else {
            FORMAT_VERSION_LAYER_PARTS
        },
        config: cfg,
        dense: entries,
        dense_file_bytes: 0,
        experts: pool,
        tokenizer: tokenizer_file,
        chat_template: tok.chat_template,
        eos_token_ids: tok.eos_token_ids,
        special_tokens: tok.special_tokens,
        generation: tok
            .generation
            .filter(|g: &GenerationDefaults| !g.is_empty()),
        source: SourceInfo {
            kind: "gguf-in-place".into(),
            path: shown,
            quant: "as stored".into(),
        },
        model_hash: String::new(),
        manifest_checksum: String::new(),
    };
    let model = SlipModel::in_place(InPlaceModel {
        path: path.to_path_buf(),
        manifest,
        converted,
        stacked,
        files,
    })?;
    Ok((model, used))
}

/// Hashes the file once: every dense tensor as the model sees it (and
/// checks it holds finite values, as repack does), every expert as the
/// record repack would write (read with `pread`, layer by layer, experts in
/// parallel).
fn build_index(
    path: &Path,
    stamp: &FileStamp,
    dense: &[crate::gguf_source::Dense<'_>],
    pool: &slipstream_format::ExpertPoolIndex,
    stacked: &[[StackedPart; 3]],
) -> Result<IndexFile> {
    let mut dense_sums = Vec::with_capacity(dense.len());
    for d in dense {
        crate::finite::check_finite(&d.name, d.qtype, d.shape, &d.bytes)?;
        dense_sums.push((d.name.clone(), hex(checksum(&d.bytes))));
    }
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    let mut experts = Vec::with_capacity(stacked.len());
    for (l, parts) in stacked.iter().enumerate() {
        let layout = pool.parts_of(l);
        let row = (0..pool.num_experts)
            .into_par_iter()
            .map_init(Vec::new, |buf: &mut Vec<u8>, e| {
                let mut bufs: Vec<Vec<u8>> = Vec::with_capacity(3);
                for s in parts {
                    let mut b = std::mem::take(buf);
                    b.clear();
                    b.resize(s.nbytes as usize, 0);
                    file.read_exact_at(&mut b, s.offset + e as u64 * s.nbytes)
                        .map_err(|err| io_err(path, err))?;
                    bufs.push(b);
                }
                let views: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
                crate::finite::check_expert_finite(l, e, layout, &views)?;
                let sum = hex(record_checksum(layout, &views));
                if let Some(b) = bufs.pop() {
                    *buf = b;
                }
                Ok(sum)
            })
            .collect::<Result<Vec<String>>>()?;
        experts.push(row);
    }
    Ok(IndexFile {
        format: INDEX_FORMAT.into(),
        version: INDEX_VERSION,
        file_bytes: stamp.bytes,
        modified_ns: stamp.modified_ns,
        header_checksum: stamp.header.clone(),
        dense: dense_sums,
        experts,
    })
}

/// The checksum-table paths a GGUF may use (for tests and tools): beside
/// the file, then in `opts.index_dir`.
pub fn index_locations(path: &Path, opts: &InPlaceOptions) -> Vec<PathBuf> {
    index_paths(path, opts)
}
