//! `index.json`, the table of contents of a checkpoint: what was trained and how, and for
//! every state tensor its global name, dtype and shape and where each of its regions lies
//! (file, byte range, checksum). It is the only file read before the shards, so every
//! question about a checkpoint (does it fit this model, which files does this rank need, is
//! a file whole) is answered from it.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The format tag of `index.json`.
pub const FORMAT: &str = "autopar-checkpoint";
/// The version of the layout this code writes and reads.
pub const VERSION: u32 = 1;

/// The contents of `index.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// Always [`FORMAT`].
    pub format: String,
    /// The layout version ([`VERSION`]).
    pub version: u32,
    /// Training steps the saved state has taken.
    pub step: u64,
    /// The seed the run drew its initial state and synthetic data from.
    pub seed: u64,
    /// Where the data stream stands: the index of the next step's batch.
    pub data_position: u64,
    /// The dynamic loss scale (f16 training) the next step uses.
    pub loss_scale: Option<f64>,
    /// The model argument it was trained as (zoo name, spec or file).
    pub model: String,
    /// The plan it was saved under.
    pub plan: PlanRecord,
    /// Every file of the checkpoint besides this one.
    pub files: Vec<FileRecord>,
    /// Every state tensor.
    pub tensors: Vec<TensorRecord>,
}

/// How the saving run was laid out (for people, and for `checkpoint inspect`); resuming
/// checks the tensors, not this.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanRecord {
    /// The mesh (`dp=2,tp=2`), or `None` for one device.
    pub mesh: Option<String>,
    /// Ranks of the mesh.
    pub ranks: usize,
    /// The other options that shape the state's layout and values.
    pub options: String,
}

/// One shard file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Its name inside the checkpoint directory.
    pub name: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// Its length in bytes.
    pub bytes: u64,
    /// SHA-256 of its bytes, in lowercase hex.
    pub sha256: String,
}

/// One state tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// Its global name.
    pub name: String,
    /// Its dtype, as the IR spells it (`f32`, `bf16`, `i32`, ...).
    pub dtype: String,
    /// Its global shape.
    pub shape: Vec<usize>,
    /// Its distinct regions; together they tile the tensor exactly.
    pub shards: Vec<ShardRecord>,
}

/// One region of a tensor, stored once however many ranks held it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// Per dim, `[start, end)` of global indices.
    pub region: Vec<[usize; 2]>,
    /// The file holding it, under the tensor's global name.
    pub file: String,
    /// Byte range of its elements in the file.
    pub offsets: [u64; 2],
    /// SHA-256 of those bytes, in lowercase hex.
    pub sha256: String,
    /// The ranks that held this region when it was saved.
    pub ranks: Vec<usize>,
}

impl ShardRecord {
    /// The region as ranges.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        self.region.iter().map(|&[a, b]| a..b).collect()
    }
}
