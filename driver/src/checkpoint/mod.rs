//! Sharded checkpoints: the training state of a run saved as one safetensors file per rank
//! plus an [`Index`], and loaded back onto any plan.
//!
//! A checkpoint is a directory `step-NNNNNNNN` under the run's checkpoint root, holding
//! `index.json` and `rank-RRRRR.safetensors` files. Every distinct region of a state tensor
//! ([`crate::StateLayout`]) is written once, by the first rank that holds it, under the
//! tensor's global name; replicas are not repeated. A save writes into a hidden temporary
//! directory, syncs every file and the directory, and only then renames it into place, so a
//! crash during a save leaves the previous checkpoints as they were and no partial one
//! visible ([`save`]).
//!
//! [`Checkpoint::load`] gives every rank of a (possibly different) layout its regions:
//! each is assembled from the saved regions it overlaps, so dp, tp, pp, cp, ep and the ZeRO
//! stage may all change between saving and resuming, and resuming on the same plan restores
//! the state bit for bit. Nothing is handed out until every file the ranks need has been
//! checked against its length and SHA-256, and every tensor against the model's name, dtype
//! and shape; an error names the file and the tensor.
//!
//! [`hf`] reads and writes Hugging Face GPT-2 and Llama weights.

mod encode;
pub mod hf;
mod index;
mod region;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use autopar_ir::{DType, TensorType};
use autopar_runtime::{Data, Tensor, TensorMap};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use sha2::{Digest, Sha256};

pub use index::{FORMAT, FileRecord, Index, PlanRecord, ShardRecord, TensorRecord, VERSION};

use crate::Error;
use crate::compile::CompiledStep;
use crate::options::CompileOptions;
use crate::state::StateLayout;
use region::{Region, overlap, volume};

/// The name of a checkpoint's table of contents.
pub const INDEX_FILE: &str = "index.json";

/// A tensor of type `ty` from its bytes as stored (see the safetensors dtypes it accepts).
pub(crate) fn decode(
    ty: &TensorType,
    stored: safetensors::Dtype,
    bytes: &[u8],
) -> Result<Tensor, String> {
    encode::from_bytes(ty, stored, bytes)
}

/// `region` of the whole tensor `t`.
pub(crate) fn slice(t: &Tensor, region: &[std::ops::Range<usize>]) -> Result<Tensor, Error> {
    let whole: Region = t.dims().iter().map(|&d| 0..d).collect();
    let n = volume(region);
    let mut data = match t.data() {
        Data::Float(_) => Data::Float(vec![0.0; n]),
        Data::Int(_) => Data::Int(vec![0; n]),
        Data::Bool(_) => Data::Bool(vec![false; n]),
    };
    if let Some(part) = overlap(&whole, region) {
        region::copy(t.data(), &whole, &mut data, region, &part);
    }
    let ty = TensorType::new(
        t.dtype(),
        region.iter().map(|r| r.len()).collect::<Vec<_>>(),
    );
    Ok(Tensor::new(ty, data)?)
}

/// The state tensor of dynamic loss scaling, whose value the index records.
const LOSS_SCALE: &str = "loss_scale";

/// What a save records besides the state.
#[derive(Clone, Debug, PartialEq)]
pub struct SaveInfo {
    /// Training steps the state has taken.
    pub step: u64,
    /// The run's seed.
    pub seed: u64,
    /// The model argument.
    pub model: String,
    /// The plan the state is laid out for.
    pub plan: PlanRecord,
    /// With dynamic loss scaling, the initial scale (`--loss-scale`): the state holds the
    /// scale relative to it, the index the scale itself.
    pub initial_loss_scale: Option<f64>,
}

/// How a save treats the checkpoints around it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// Keep at most this many checkpoints under the root (the newest); `None` keeps all.
    pub keep: Option<usize>,
    /// Test-only fault injection: abort the whole process, as a kill would, after writing
    /// this many shard files of the save (before its index and its rename).
    pub crash_after_files: Option<usize>,
}

/// The plan record of a step compiled from `options`.
pub fn plan_record(options: &CompileOptions, step: &CompiledStep) -> PlanRecord {
    let t = &options.train;
    let mut parts = vec![
        format!("dtype={}", t.compute_dtype),
        format!("optimizer={:?}", t.optimizer),
        format!("micro-batches={}", t.micro_batches),
        format!("recompute={:?}", t.recompute),
    ];
    if options.mesh.is_some() {
        parts.push(format!("zero={}", options.parallel.zero));
        if options.parallel.sequence_parallel {
            parts.push("sp".into());
        }
    }
    if t.loss_scaling.is_some() {
        parts.push("dynamic-loss-scaling".into());
    }
    if options.forward_only {
        parts.push("forward".into());
    }
    PlanRecord {
        mesh: options
            .mesh
            .as_ref()
            .map(|m| m.to_string().replace(", ", ",")),
        ranks: step.mesh.num_devices(),
        options: parts.join(" "),
    }
}

/// The directory name of the checkpoint after `step` steps.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Saves `states` (every rank's state, in rank order, laid out as `layout` says) as the
/// checkpoint of `info.step` under `root`, atomically; returns its directory.
pub fn save(
    root: &Path,
    layout: &StateLayout,
    states: &[TensorMap],
    info: &SaveInfo,
    options: &SaveOptions,
) -> Result<PathBuf, Error> {
    fs::create_dir_all(root).map_err(|e| io(root, e))?;
    remove_stale_temporaries(root)?;
    let tmp = root.join(format!(
        ".tmp-{}-{}",
        step_dir_name(info.step),
        std::process::id()
    ));
    fs::create_dir(&tmp).map_err(|e| io(&tmp, e))?;
    let mut files = Vec::new();
    let mut records: Vec<TensorRecord> = layout
        .tensors
        .iter()
        .map(|t| TensorRecord {
            name: t.name.clone(),
            dtype: t.ty.dtype.to_string(),
            shape: t.ty.dims().to_vec(),
            shards: Vec::new(),
        })
        .collect();
    for rank in 0..layout.num_ranks {
        // The regions this rank is the first holder of.
        let mut entries: Vec<(usize, usize, Vec<u8>, Vec<usize>)> = Vec::new();
        for (ti, t) in layout.tensors.iter().enumerate() {
            for (si, shard) in t.shards.iter().enumerate() {
                if shard.ranks.first() != Some(&rank) {
                    continue;
                }
                let local = states
                    .get(rank)
                    .and_then(|s| s.get(&t.name))
                    .ok_or_else(|| {
                        Error::Usage(format!(
                            "saving: rank {rank} does not hold its shard of `{}`",
                            t.name
                        ))
                    })?;
                let dims: Vec<usize> = shard.region.iter().map(|r| r.len()).collect();
                if local.dims() != dims.as_slice() || local.dtype() != t.ty.dtype {
                    return Err(Error::Usage(format!(
                        "saving: rank {rank}'s shard of `{}` is {} where its region is {}",
                        t.name,
                        local.ty(),
                        TensorType::new(t.ty.dtype, dims)
                    )));
                }
                entries.push((ti, si, encode::to_bytes(local), dims));
            }
        }
        if entries.is_empty() {
            continue;
        }
        let name = format!("rank-{rank:05}.safetensors");
        let views = entries
            .iter()
            .map(|(ti, _, bytes, dims)| {
                let t = &layout.tensors[*ti];
                TensorView::new(encode::st_dtype(t.ty.dtype), dims.clone(), bytes)
                    .map(|v| (t.name.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| checkpoint_error(&tmp.join(&name), format!("cannot encode: {e}")))?;
        let meta = HashMap::from([("autopar.rank".to_string(), rank.to_string())]);
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| checkpoint_error(&tmp.join(&name), format!("cannot encode: {e}")))?;
        let (header, metadata) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| checkpoint_error(&tmp.join(&name), format!("cannot encode: {e}")))?;
        let data_start = 8 + header as u64;
        for (ti, si, _, _) in &entries {
            let t = &layout.tensors[*ti];
            let shard = &t.shards[*si];
            let info = metadata.info(&t.name).ok_or_else(|| {
                checkpoint_error(&tmp.join(&name), format!("lost `{}` in encoding", t.name))
            })?;
            let (a, b) = info.data_offsets;
            let offsets = [data_start + a as u64, data_start + b as u64];
            records[*ti].shards.push(ShardRecord {
                region: shard.region.iter().map(|r| [r.start, r.end]).collect(),
                file: name.clone(),
                offsets,
                sha256: sha256(&bytes[offsets[0] as usize..offsets[1] as usize]),
                ranks: shard.ranks.clone(),
            });
        }
        write_synced(&tmp.join(&name), &bytes)?;
        files.push(FileRecord {
            name: name.clone(),
            rank,
            bytes: bytes.len() as u64,
            sha256: sha256(&bytes),
        });
        if options.crash_after_files == Some(files.len()) {
            // A kill in the middle of the save, as far as the files on disk can tell.
            std::process::abort();
        }
    }
    let loss_scale = layout
        .tensors
        .iter()
        .find(|t| t.name == LOSS_SCALE)
        .and_then(|t| t.shards.first())
        .and_then(|s| states.get(*s.ranks.first()?)?.get(LOSS_SCALE))
        .and_then(Tensor::scalar_value)
        .map(|relative| relative * info.initial_loss_scale.unwrap_or(1.0));
    let index = Index {
        format: FORMAT.into(),
        version: VERSION,
        step: info.step,
        seed: info.seed,
        data_position: info.step,
        loss_scale,
        model: info.model.clone(),
        plan: info.plan.clone(),
        files,
        tensors: records,
    };
    let text = serde_json::to_string_pretty(&index)
        .map_err(|e| checkpoint_error(&tmp, format!("cannot encode the index: {e}")))?;
    write_synced(&tmp.join(INDEX_FILE), text.as_bytes())?;
    sync_dir(&tmp)?;
    let target = root.join(step_dir_name(info.step));
    if target.exists() {
        // Saving a step again replaces it; the old one goes only once the new one is in place.
        let old = root.join(format!(".tmp-replaced-{}", step_dir_name(info.step)));
        fs::rename(&target, &old).map_err(|e| io(&target, e))?;
        fs::rename(&tmp, &target).map_err(|e| io(&target, e))?;
        fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    } else {
        fs::rename(&tmp, &target).map_err(|e| io(&target, e))?;
    }
    sync_dir(root)?;
    if let Some(keep) = options.keep {
        let all = list(root)?;
        for (_, dir) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
            fs::remove_dir_all(dir).map_err(|e| io(dir, e))?;
        }
    }
    Ok(target)
}

/// The complete checkpoints under `root`, oldest first: `(step, directory)`.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>, Error> {
    let mut out = Vec::new();
    for entry in fs::read_dir(root).map_err(|e| io(root, e))? {
        let entry = entry.map_err(|e| io(root, e))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(INDEX_FILE).is_file() {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Removes what crashed saves left behind (hidden temporary directories).
fn remove_stale_temporaries(root: &Path) -> Result<(), Error> {
    for entry in fs::read_dir(root).map_err(|e| io(root, e))? {
        let entry = entry.map_err(|e| io(root, e))?;
        if entry.file_name().to_string_lossy().starts_with(".tmp-") {
            let path = entry.path();
            fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
        }
    }
    Ok(())
}

/// An opened checkpoint: its directory and its checked index.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// The `step-NNNNNNNN` directory.
    pub dir: PathBuf,
    /// Its table of contents.
    pub index: Index,
}

impl Checkpoint {
    /// Opens the checkpoint at `path`: a checkpoint directory, or a root holding several,
    /// of which the newest complete one is taken.
    pub fn open(path: &Path) -> Result<Checkpoint, Error> {
        let dir = if path.join(INDEX_FILE).is_file() {
            path.to_path_buf()
        } else if path.is_dir() {
            list(path)?
                .pop()
                .map(|(_, d)| d)
                .ok_or_else(|| checkpoint_error(path, "holds no complete checkpoint".into()))?
        } else {
            return Err(checkpoint_error(
                path,
                "is not a checkpoint directory".into(),
            ));
        };
        let index_path = dir.join(INDEX_FILE);
        let text = fs::read_to_string(&index_path).map_err(|e| io(&index_path, e))?;
        let index: Index = serde_json::from_str(&text).map_err(|e| {
            checkpoint_error(&index_path, format!("is not a checkpoint index: {e}"))
        })?;
        let ckpt = Checkpoint { dir, index };
        ckpt.check_index()?;
        Ok(ckpt)
    }

    /// The index's own consistency: its format, and every tensor's shards tiling it exactly
    /// and naming listed files.
    fn check_index(&self) -> Result<(), Error> {
        let path = self.dir.join(INDEX_FILE);
        let bad = |detail: String| checkpoint_error(&path, detail);
        if self.index.format != FORMAT || self.index.version != VERSION {
            return Err(bad(format!(
                "is `{}` version {}, not `{FORMAT}` version {VERSION}",
                self.index.format, self.index.version
            )));
        }
        for t in &self.index.tensors {
            let ty = record_type(t).map_err(bad)?;
            let mut covered = 0usize;
            for (i, s) in t.shards.iter().enumerate() {
                let r = s.ranges();
                let inside = r.len() == t.shape.len()
                    && r.iter()
                        .zip(&t.shape)
                        .all(|(r, &d)| r.start < r.end && r.end <= d);
                if !inside {
                    return Err(bad(format!(
                        "region {:?} of `{}` is outside its shape {:?}",
                        s.region, t.name, t.shape
                    )));
                }
                if t.shards[..i]
                    .iter()
                    .any(|o| overlap(&o.ranges(), &r).is_some())
                {
                    return Err(bad(format!("two regions of `{}` overlap", t.name)));
                }
                if !self.index.files.iter().any(|f| f.name == s.file) {
                    return Err(bad(format!(
                        "`{}` is said to be in `{}`, which is not a file of the checkpoint",
                        t.name, s.file
                    )));
                }
                covered += volume(&r);
            }
            if covered as u64 != ty.num_elements() {
                return Err(bad(format!(
                    "the regions of `{}` cover {covered} of its {} elements",
                    t.name,
                    ty.num_elements()
                )));
            }
        }
        Ok(())
    }

    /// The record of tensor `name`.
    pub fn tensor_record(&self, name: &str) -> Option<&TensorRecord> {
        self.index.tensors.iter().find(|t| t.name == name)
    }

    /// Every rank's state for `layout`: each rank's regions assembled from the saved ones,
    /// after checking that the checkpoint holds exactly the model's state tensors with
    /// their dtypes and shapes and that every file read is whole. On any error nothing is
    /// returned.
    pub fn load(&self, layout: &StateLayout) -> Result<Vec<TensorMap>, Error> {
        self.check_fits(layout, false)?;
        let mut files = FileCache::default();
        (0..layout.num_ranks)
            .map(|rank| self.load_rank(layout, rank, &mut files))
            .collect()
    }

    /// Like [`Checkpoint::load`] for a layout whose tensors are some of the checkpoint's
    /// (the weights of a training checkpoint, for a forward pass); the others are left.
    pub fn load_subset(&self, layout: &StateLayout) -> Result<Vec<TensorMap>, Error> {
        self.check_fits(layout, true)?;
        let mut files = FileCache::default();
        (0..layout.num_ranks)
            .map(|rank| self.load_rank(layout, rank, &mut files))
            .collect()
    }

    /// That the checkpoint's tensors are the state tensors of `layout`, name for name, with
    /// the same dtypes and shapes.
    /// With `extra`, the checkpoint may hold more tensors than the layout.
    pub fn check_fits(&self, layout: &StateLayout, extra: bool) -> Result<(), Error> {
        let path = self.dir.join(INDEX_FILE);
        for t in &layout.tensors {
            let Some(rec) = self.tensor_record(&t.name) else {
                return Err(checkpoint_error(
                    &path,
                    format!("has no tensor `{}`, which the model's state has", t.name),
                ));
            };
            let saved = record_type(rec).map_err(|e| checkpoint_error(&path, e))?;
            if saved != t.ty {
                return Err(checkpoint_error(
                    &path,
                    format!("holds `{}` as {saved}, but the model's is {}", t.name, t.ty),
                ));
            }
        }
        if let Some(extra) = self
            .index
            .tensors
            .iter()
            .filter(|_| !extra)
            .find(|rec| !layout.tensors.iter().any(|t| t.name == rec.name))
        {
            return Err(checkpoint_error(
                &path,
                format!(
                    "holds `{}`, which is not part of this model's state (another model, \
                     optimizer or dtype?)",
                    extra.name
                ),
            ));
        }
        Ok(())
    }

    /// The state rank `rank` of `layout` holds, read from the files its regions overlap.
    fn load_rank(
        &self,
        layout: &StateLayout,
        rank: usize,
        files: &mut FileCache,
    ) -> Result<TensorMap, Error> {
        let mut state = TensorMap::new();
        for t in &layout.tensors {
            let Some(shard) = t.shards.iter().find(|s| s.ranks.contains(&rank)) else {
                continue;
            };
            state.insert(
                t.name.clone(),
                self.read_region(&t.name, &t.ty, &shard.region, files)?,
            );
        }
        Ok(state)
    }

    /// Tensor `name`, whole.
    pub fn tensor(&self, name: &str) -> Result<Tensor, Error> {
        let path = self.dir.join(INDEX_FILE);
        let rec = self
            .tensor_record(name)
            .ok_or_else(|| checkpoint_error(&path, format!("has no tensor `{name}`")))?;
        let ty = record_type(rec).map_err(|e| checkpoint_error(&path, e))?;
        let whole: Region = ty.dims().iter().map(|&d| 0..d).collect();
        self.read_region(name, &ty, &whole, &mut FileCache::default())
    }

    /// `region` of tensor `name` (global type `ty`), assembled from the saved regions it
    /// overlaps.
    fn read_region(
        &self,
        name: &str,
        ty: &TensorType,
        region: &[std::ops::Range<usize>],
        files: &mut FileCache,
    ) -> Result<Tensor, Error> {
        let rec = self.tensor_record(name).ok_or_else(|| {
            checkpoint_error(
                &self.dir.join(INDEX_FILE),
                format!("has no tensor `{name}`"),
            )
        })?;
        let n = volume(region);
        let mut data = match ty.dtype {
            DType::Bool => Data::Bool(vec![false; n]),
            d if d.is_float() => Data::Float(vec![0.0; n]),
            _ => Data::Int(vec![0; n]),
        };
        for s in &rec.shards {
            let saved = s.ranges();
            let Some(part) = overlap(&saved, region) else {
                continue;
            };
            let shard = self.read_shard(rec, s, ty.dtype, files)?;
            region::copy(shard.data(), &saved, &mut data, region, &part);
        }
        let local = TensorType::new(ty.dtype, region.iter().map(|r| r.len()).collect::<Vec<_>>());
        Ok(Tensor::new(local, data)?)
    }

    /// One saved region, decoded, from its checked file.
    fn read_shard(
        &self,
        rec: &TensorRecord,
        s: &ShardRecord,
        dtype: DType,
        files: &mut FileCache,
    ) -> Result<Tensor, Error> {
        let path = self.dir.join(&s.file);
        let bytes = files.get(self, &s.file)?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| {
            checkpoint_error(
                &path,
                format!("cannot be read ({e}); it holds `{}`", rec.name),
            )
        })?;
        let view = st.tensor(&rec.name).map_err(|_| {
            checkpoint_error(
                &path,
                format!("does not hold `{}` as its index says", rec.name),
            )
        })?;
        let dims: Vec<usize> = s.ranges().iter().map(|r| r.len()).collect();
        if view.shape() != dims.as_slice() {
            return Err(checkpoint_error(
                &path,
                format!(
                    "holds `{}` with shape {:?}, not its region's {dims:?}",
                    rec.name,
                    view.shape()
                ),
            ));
        }
        encode::from_bytes(&TensorType::new(dtype, dims), view.dtype(), view.data())
            .map_err(|e| checkpoint_error(&path, format!("`{}` {e}", rec.name)))
    }
}

/// The shard files read so far, each checked whole once.
#[derive(Default)]
struct FileCache {
    files: BTreeMap<String, Vec<u8>>,
}

impl FileCache {
    /// The bytes of file `name` of `ckpt`, read and checked on first use: its length and
    /// checksum against the index; a mismatch names the first tensor it spoils.
    fn get(&mut self, ckpt: &Checkpoint, name: &str) -> Result<&[u8], Error> {
        if !self.files.contains_key(name) {
            let bytes = check_file(ckpt, name)?;
            self.files.insert(name.to_string(), bytes);
        }
        Ok(self.files.get(name).map(Vec::as_slice).unwrap_or_default())
    }
}

/// Reads file `name` of `ckpt` and checks it against the index.
fn check_file(ckpt: &Checkpoint, name: &str) -> Result<Vec<u8>, Error> {
    let path = ckpt.dir.join(name);
    let shards: Vec<(&TensorRecord, &ShardRecord)> = ckpt
        .index
        .tensors
        .iter()
        .flat_map(|t| {
            t.shards
                .iter()
                .filter(|s| s.file == name)
                .map(move |s| (t, s))
        })
        .collect();
    let holds = |shards: &[(&TensorRecord, &ShardRecord)]| match shards {
        [] => "no tensors".to_string(),
        [(t, _)] => format!("`{}`", t.name),
        [(t, _), rest @ ..] => format!("`{}` and {} more", t.name, rest.len()),
    };
    let record = ckpt
        .index
        .files
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| checkpoint_error(&path, "is not listed in the index".into()))?;
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(checkpoint_error(
                &path,
                format!("is missing; it holds {}", holds(&shards)),
            ));
        }
        Err(e) => return Err(io(&path, e)),
    };
    let len = bytes.len() as u64;
    if len < record.bytes {
        // The tensor the file ends inside, or else the first one wholly lost.
        let cut = shards
            .iter()
            .find(|(_, s)| s.offsets[0] <= len && len < s.offsets[1])
            .or_else(|| {
                shards
                    .iter()
                    .filter(|(_, s)| s.offsets[0] > len)
                    .min_by_key(|(_, s)| s.offsets[0])
            })
            .map(|(t, _)| format!("`{}` is cut off", t.name))
            .unwrap_or_else(|| "its header is cut off".into());
        return Err(checkpoint_error(
            &path,
            format!("is truncated ({len} of {} bytes): {cut}", record.bytes),
        ));
    }
    if len > record.bytes {
        return Err(checkpoint_error(
            &path,
            format!(
                "has {len} bytes, {} more than when it was saved; it holds {}",
                len - record.bytes,
                holds(&shards)
            ),
        ));
    }
    if sha256(&bytes) != record.sha256 {
        let spoiled = shards.iter().find(|(_, s)| {
            bytes
                .get(s.offsets[0] as usize..s.offsets[1] as usize)
                .is_none_or(|b| sha256(b) != s.sha256)
        });
        let what = match spoiled {
            Some((t, _)) => format!("the bytes of `{}` do not match their checksum", t.name),
            None => format!("its header is corrupt (it holds {})", holds(&shards)),
        };
        return Err(checkpoint_error(&path, format!("is corrupt: {what}")));
    }
    Ok(bytes)
}

/// The global type a tensor record describes.
fn record_type(t: &TensorRecord) -> Result<TensorType, String> {
    let dtype = DType::from_name(&t.dtype)
        .ok_or_else(|| format!("gives `{}` the unknown dtype `{}`", t.name, t.dtype))?;
    Ok(TensorType::new(dtype, t.shape.clone()))
}

/// Lowercase hex SHA-256 of `bytes`.
fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `bytes` to `path` and syncs them to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let mut f = fs::File::create(path).map_err(|e| io(path, e))?;
    f.write_all(bytes).map_err(|e| io(path, e))?;
    f.sync_all().map_err(|e| io(path, e))
}

/// Syncs a directory's entries to disk (a rename is durable only then).
fn sync_dir(path: &Path) -> Result<(), Error> {
    fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(path, e))
}

fn io(path: &Path, error: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        error,
    }
}

/// The error of a checkpoint, weights or data file `path`.
pub(crate) fn checkpoint_error(path: &Path, detail: String) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        detail,
    }
}
