//! State snapshots: the whole [`ModelState`] after a prefill (KV of the
//! full-attention layers, conv and recurrent state of the linear layers, the
//! token ids, the next-token logits) plus the experts the cache held, in one
//! checksummed file written atomically.
//!
//! # File format (version 1, all integers little endian)
//!
//! ```text
//! header, 32 bytes
//!   0  magic          8 bytes  "SLIPSNAP"
//!   8  version        u32      SNAPSHOT_VERSION
//!  12  reserved       u32      0
//!  16  payload_len    u64      must equal file size - 32
//!  24  payload_xxh3   u64      xxh3-64 of the payload bytes
//! payload
//!   model_hash        u32 len, then that many UTF-8 bytes (manifest.model_hash)
//!   layers            u32
//!   tokens            u64 n, then n x u32
//!   last_logits       u64 n, then n x f32
//!   per layer         u8 tag
//!     tag 0 (attention)  u32 kv_dim, u64 rows, rows*kv_dim f32 K, then V
//!     tag 1 (linear)     u64 n, n f32 conv; u64 m, m f32 recurrent
//!   resident experts  u32 layers (0 or the expert pool's layer count, MTP
//!                     layers included), per layer u32 n,
//!                     then n x u32 expert ids
//! ```
//!
//! Reading is bounded: every length is checked against the bytes the header
//! says remain before anything is allocated, and the header's length is
//! checked against the file size. The payload is hashed while it is parsed
//! and the state is dropped unless the checksum matches at the end, so a
//! corrupted file never yields a state. Against the opened model a snapshot
//! must then match the model hash, layer count and kinds, KV width, linear
//! state sizes, vocabulary and token count; any difference is a
//! [`SnapshotError`], which callers treat as "prefill from scratch".
//!
//! Writing goes to a temporary file beside the target (`.NAME.tmp.PID.N`),
//! is fsynced, renamed over the target and the directory fsynced: a process
//! killed mid-write leaves at most a temporary file, which no reader opens,
//! and a final-named file cut short fails the length or checksum check.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use slipstream_models::state::{AttnState, LayerState, LinearState};
use slipstream_models::ModelState;
use xxhash_rust::xxh3::Xxh3;

pub const SNAPSHOT_MAGIC: [u8; 8] = *b"SLIPSNAP";
/// Bumped whenever the layout above changes; other versions are refused.
pub const SNAPSHOT_VERSION: u32 = 1;
pub const HEADER_BYTES: u64 = 32;

/// Why a snapshot could not be used. Every case means "prefill instead".
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a slipstream snapshot (bad magic)")]
    NotASnapshot,
    #[error("snapshot format version {found}, this build reads version {expected}")]
    Version { found: u32, expected: u32 },
    #[error("snapshot is truncated or padded: {0}")]
    Truncated(String),
    #[error("snapshot checksum mismatch (corrupted or partially written)")]
    Checksum,
    #[error("snapshot was taken with another model (hash {found}, this model {expected})")]
    OtherModel { found: String, expected: String },
    #[error("snapshot does not fit this model: {0}")]
    Shape(String),
}

/// A decoded snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub model_hash: String,
    pub state: ModelState,
    /// Experts the cache held when the snapshot was taken, per layer.
    pub resident: Vec<Vec<u32>>,
}

/// The shape of one layer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerShape {
    Attn { kv_dim: usize },
    Linear { conv: usize, recurrent: usize },
}

impl LayerShape {
    /// The shapes of a (fresh) state's layers.
    pub fn of(state: &ModelState) -> Vec<LayerShape> {
        state
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Attn(a) => LayerShape::Attn { kv_dim: a.kv_dim },
                LayerState::Linear(s) => LayerShape::Linear {
                    conv: s.conv.len(),
                    recurrent: s.recurrent.len(),
                },
            })
            .collect()
    }
}

/// What a snapshot must match to be accepted: the opened model.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotExpect {
    pub model_hash: String,
    pub layers: Vec<LayerShape>,
    pub vocab_size: usize,
    pub num_experts: usize,
    /// Layers of the expert pool: `layers.len()` plus the MTP layers,
    /// whose experts the store keeps resident too.
    pub expert_layers: usize,
}

/// Bytes a snapshot of `state` with `resident` takes on disk.
pub fn encoded_len(model_hash: &str, state: &ModelState, resident: &[Vec<u32>]) -> u64 {
    let mut n = 4 + model_hash.len() as u64 + 4;
    n += 8 + 4 * state.tokens.len() as u64;
    n += 8 + 4 * state.last_logits.len() as u64;
    for l in &state.layers {
        n += 1;
        n += match l {
            LayerState::Attn(a) => 4 + 8 + 4 * (a.k.len() + a.v.len()) as u64,
            LayerState::Linear(s) => 16 + 4 * (s.conv.len() + s.recurrent.len()) as u64,
        };
    }
    n += 4;
    for r in resident {
        n += 4 + 4 * r.len() as u64;
    }
    HEADER_BYTES + n
}

struct HashWriter<W: Write> {
    out: W,
    hash: Xxh3,
    written: u64,
}

impl<W: Write> HashWriter<W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.hash.update(b);
        self.written += b.len() as u64;
        self.out.write_all(b)
    }
    fn u8(&mut self, v: u8) -> std::io::Result<()> {
        self.put(&[v])
    }
    fn u32(&mut self, v: u32) -> std::io::Result<()> {
        self.put(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> std::io::Result<()> {
        self.put(&v.to_le_bytes())
    }
    fn u32s(&mut self, v: &[u32]) -> std::io::Result<()> {
        self.words(v, u32::to_le_bytes)
    }
    fn f32s(&mut self, v: &[f32]) -> std::io::Result<()> {
        self.words(v, f32::to_le_bytes)
    }
    /// `v` as 4-byte little-endian words (`le`), 64 Ki words per write.
    fn words<T: Copy>(&mut self, v: &[T], le: fn(T) -> [u8; 4]) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(v.len().min(1 << 16) * 4);
        for c in v.chunks(1 << 16) {
            buf.clear();
            for &x in c {
                buf.extend_from_slice(&le(x));
            }
            self.put(&buf)?;
        }
        Ok(())
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary path beside `path` that no reader ever opens.
pub(crate) fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "snapshot".into());
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tmp.{}.{n}", std::process::id()))
}

/// Writes a snapshot atomically (temp file, fsync, rename, directory
/// fsync). Returns the bytes written.
pub fn write_snapshot(
    path: &Path,
    model_hash: &str,
    state: &ModelState,
    resident: &[Vec<u32>],
) -> Result<u64, SnapshotError> {
    let tmp = temp_path(path);
    let result = write_to(&tmp, model_hash, state, resident).and_then(|n| {
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            // Best effort: some filesystems refuse to fsync a directory.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(n)
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn write_to(
    tmp: &Path,
    model_hash: &str,
    state: &ModelState,
    resident: &[Vec<u32>],
) -> Result<u64, SnapshotError> {
    let total = encoded_len(model_hash, state, resident);
    let file = File::create(tmp)?;
    let mut w = HashWriter {
        out: BufWriter::with_capacity(1 << 20, file),
        hash: Xxh3::new(),
        written: 0,
    };
    // Placeholder header; the real one is written once the hash is known.
    w.out.write_all(&[0u8; HEADER_BYTES as usize])?;
    w.u32(model_hash.len() as u32)?;
    w.put(model_hash.as_bytes())?;
    w.u32(state.layers.len() as u32)?;
    w.u64(state.tokens.len() as u64)?;
    w.u32s(&state.tokens)?;
    w.u64(state.last_logits.len() as u64)?;
    w.f32s(&state.last_logits)?;
    for l in &state.layers {
        match l {
            LayerState::Attn(a) => {
                w.u8(0)?;
                w.u32(a.kv_dim as u32)?;
                w.u64(a.len() as u64)?;
                w.f32s(&a.k)?;
                w.f32s(&a.v)?;
            }
            LayerState::Linear(s) => {
                w.u8(1)?;
                w.u64(s.conv.len() as u64)?;
                w.f32s(&s.conv)?;
                w.u64(s.recurrent.len() as u64)?;
                w.f32s(&s.recurrent)?;
            }
        }
    }
    w.u32(resident.len() as u32)?;
    for r in resident {
        w.u32(r.len() as u32)?;
        w.u32s(r)?;
    }
    let payload_len = w.written;
    debug_assert_eq!(payload_len + HEADER_BYTES, total);
    let digest = w.hash.digest();
    let mut file = w.out.into_inner().map_err(|e| e.into_error())?;
    let mut header = Vec::with_capacity(HEADER_BYTES as usize);
    header.extend_from_slice(&SNAPSHOT_MAGIC);
    header.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&payload_len.to_le_bytes());
    header.extend_from_slice(&digest.to_le_bytes());
    file.seek(SeekFrom::Start(0))?;
    file.write_all(&header)?;
    file.sync_all()?;
    Ok(payload_len + HEADER_BYTES)
}

struct HashReader<R: Read> {
    inp: R,
    hash: Xxh3,
    left: u64,
    buf: Vec<u8>,
}

impl<R: Read> HashReader<R> {
    fn take(&mut self, n: u64, what: &str) -> Result<(), SnapshotError> {
        if n > self.left {
            return Err(SnapshotError::Truncated(format!(
                "{what} needs {n} bytes, {} left",
                self.left
            )));
        }
        self.buf.resize(n as usize, 0);
        self.inp.read_exact(&mut self.buf)?;
        self.hash.update(&self.buf);
        self.left -= n;
        Ok(())
    }
    fn u8(&mut self, what: &str) -> Result<u8, SnapshotError> {
        self.take(1, what)?;
        Ok(self.buf[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, SnapshotError> {
        self.take(4, what)?;
        Ok(u32::from_le_bytes(self.buf[..4].try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, SnapshotError> {
        self.take(8, what)?;
        Ok(u64::from_le_bytes(self.buf[..8].try_into().unwrap()))
    }
    /// Checks `n` 4-byte items fit in what is left before allocating.
    fn check_words(&self, n: u64, what: &str) -> Result<(), SnapshotError> {
        match n.checked_mul(4) {
            Some(b) if b <= self.left => Ok(()),
            _ => Err(SnapshotError::Truncated(format!(
                "{what}: {n} items do not fit in the {} bytes left",
                self.left
            ))),
        }
    }
    fn words<T>(
        &mut self,
        n: u64,
        what: &str,
        f: impl Fn([u8; 4]) -> T,
    ) -> Result<Vec<T>, SnapshotError> {
        self.check_words(n, what)?;
        let mut out = Vec::with_capacity(n as usize);
        let mut left = n;
        while left > 0 {
            let step = left.min(1 << 18);
            self.take(step * 4, what)?;
            out.extend(
                self.buf
                    .chunks_exact(4)
                    .map(|c| f([c[0], c[1], c[2], c[3]])),
            );
            left -= step;
        }
        Ok(out)
    }
    fn u32s(&mut self, n: u64, what: &str) -> Result<Vec<u32>, SnapshotError> {
        self.words(n, what, u32::from_le_bytes)
    }
    fn f32s(&mut self, n: u64, what: &str) -> Result<Vec<f32>, SnapshotError> {
        self.words(n, what, f32::from_le_bytes)
    }
}

/// Reads only the header and the model hash: cheap checks before a full read.
fn read_header(file: &mut File) -> Result<(u64, u64), SnapshotError> {
    let size = file.metadata()?.len();
    if size == 0 {
        return Err(SnapshotError::Truncated("the file is empty".into()));
    }
    if size < HEADER_BYTES {
        return Err(SnapshotError::Truncated(format!(
            "{size} bytes, shorter than the {HEADER_BYTES}-byte header"
        )));
    }
    let mut header = [0u8; HEADER_BYTES as usize];
    file.read_exact(&mut header)?;
    if header[..8] != SNAPSHOT_MAGIC {
        return Err(SnapshotError::NotASnapshot);
    }
    let version = u32::from_le_bytes(header[8..12].try_into().unwrap());
    if version != SNAPSHOT_VERSION {
        return Err(SnapshotError::Version {
            found: version,
            expected: SNAPSHOT_VERSION,
        });
    }
    let payload_len = u64::from_le_bytes(header[16..24].try_into().unwrap());
    let digest = u64::from_le_bytes(header[24..32].try_into().unwrap());
    if payload_len != size - HEADER_BYTES {
        return Err(SnapshotError::Truncated(format!(
            "header says {payload_len} payload bytes, the file holds {}",
            size - HEADER_BYTES
        )));
    }
    Ok((payload_len, digest))
}

/// Opens a snapshot file: a regular file only (a FIFO would hang here).
fn open_snapshot(path: &Path) -> Result<File, SnapshotError> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(SnapshotError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        )));
    }
    Ok(File::open(path)?)
}

/// Reads and checks a snapshot against the opened model.
pub fn read_snapshot(path: &Path, expect: &SnapshotExpect) -> Result<Snapshot, SnapshotError> {
    let mut file = open_snapshot(path)?;
    let (payload_len, digest) = read_header(&mut file)?;
    let mut r = HashReader {
        inp: BufReader::with_capacity(1 << 20, file),
        hash: Xxh3::new(),
        left: payload_len,
        buf: Vec::new(),
    };
    let hash_len = r.u32("model hash length")? as u64;
    if hash_len > 1024 {
        return Err(SnapshotError::Shape(format!(
            "model hash of {hash_len} bytes"
        )));
    }
    r.take(hash_len, "model hash")?;
    let model_hash = String::from_utf8_lossy(&r.buf).into_owned();
    if model_hash != expect.model_hash {
        return Err(SnapshotError::OtherModel {
            found: model_hash,
            expected: expect.model_hash.to_string(),
        });
    }
    let layers = r.u32("layer count")? as usize;
    if layers != expect.layers.len() {
        return Err(SnapshotError::Shape(format!(
            "{layers} layers, the model has {}",
            expect.layers.len()
        )));
    }
    let n_tokens = r.u64("token count")?;
    let tokens = r.u32s(n_tokens, "tokens")?;
    if tokens.is_empty() {
        return Err(SnapshotError::Shape("no tokens".into()));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= expect.vocab_size) {
        return Err(SnapshotError::Shape(format!(
            "token {bad} is outside the vocabulary"
        )));
    }
    let n_logits = r.u64("logit count")?;
    if n_logits != expect.vocab_size as u64 {
        return Err(SnapshotError::Shape(format!(
            "{n_logits} logits, the vocabulary has {}",
            expect.vocab_size
        )));
    }
    let last_logits = r.f32s(n_logits, "logits")?;
    let mut states = Vec::with_capacity(layers);
    for (i, t) in expect.layers.iter().enumerate() {
        let tag = r.u8("layer tag")?;
        match (tag, t) {
            (0, &LayerShape::Attn { kv_dim: want_kv }) => {
                let kv_dim = r.u32("kv width")? as usize;
                if kv_dim != want_kv {
                    return Err(SnapshotError::Shape(format!(
                        "layer {i}: KV width {kv_dim}, the model has {want_kv}"
                    )));
                }
                let rows = r.u64("kv rows")?;
                if rows != n_tokens {
                    return Err(SnapshotError::Shape(format!(
                        "layer {i}: {rows} KV rows for {n_tokens} tokens"
                    )));
                }
                let n = rows.checked_mul(kv_dim as u64).ok_or_else(|| {
                    SnapshotError::Truncated(format!("layer {i}: KV size overflows"))
                })?;
                let k = r.f32s(n, "keys")?;
                let v = r.f32s(n, "values")?;
                states.push(LayerState::Attn(AttnState { k, v, kv_dim }));
            }
            (
                1,
                &LayerShape::Linear {
                    conv: want_conv,
                    recurrent: want_rec,
                },
            ) => {
                let n = r.u64("conv length")?;
                if n != want_conv as u64 {
                    return Err(SnapshotError::Shape(format!(
                        "layer {i}: conv state of {n} values, the model has {want_conv}"
                    )));
                }
                let conv = r.f32s(n, "conv state")?;
                let m = r.u64("recurrent length")?;
                if m != want_rec as u64 {
                    return Err(SnapshotError::Shape(format!(
                        "layer {i}: recurrent state of {m} values, the model has {want_rec}"
                    )));
                }
                let recurrent = r.f32s(m, "recurrent state")?;
                states.push(LayerState::Linear(LinearState { conv, recurrent }));
            }
            (tag, _) => {
                return Err(SnapshotError::Shape(format!(
                    "layer {i}: kind tag {tag} does not match the model's layer"
                )))
            }
        }
    }
    let res_layers = r.u32("resident layer count")? as usize;
    // 0: the writer recorded no resident experts (e.g. a resident store).
    if res_layers != expect.expert_layers && res_layers != 0 {
        return Err(SnapshotError::Shape(format!(
            "resident experts for {res_layers} layers, the model's expert pool has {}",
            expect.expert_layers
        )));
    }
    let mut resident = Vec::with_capacity(res_layers);
    for _ in 0..res_layers {
        let n = r.u32("resident count")? as u64;
        let ids = r.u32s(n, "resident experts")?;
        if ids.iter().any(|&e| e as usize >= expect.num_experts) {
            return Err(SnapshotError::Shape(
                "resident expert id out of range".into(),
            ));
        }
        resident.push(ids);
    }
    if r.left != 0 {
        return Err(SnapshotError::Truncated(format!(
            "{} bytes after the payload",
            r.left
        )));
    }
    if r.hash.digest() != digest {
        return Err(SnapshotError::Checksum);
    }
    Ok(Snapshot {
        model_hash,
        state: ModelState {
            layers: states,
            tokens,
            last_logits,
        },
        resident,
    })
}

/// The token ids a snapshot holds, read without the checksum over the
/// whole file (a hint only: [`read_snapshot`] still decides).
pub fn peek_tokens(path: &Path) -> Result<Vec<u32>, SnapshotError> {
    let mut file = open_snapshot(path)?;
    let (payload_len, _) = read_header(&mut file)?;
    let mut r = HashReader {
        inp: BufReader::new(file),
        hash: Xxh3::new(),
        left: payload_len,
        buf: Vec::new(),
    };
    let hash_len = r.u32("model hash length")? as u64;
    r.take(hash_len, "model hash")?;
    r.u32("layer count")?;
    let n = r.u64("token count")?;
    r.u32s(n, "tokens")
}
