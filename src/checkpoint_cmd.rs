//! Checkpoints on the command line: the `--checkpoint`, `--resume`, `--init-from` and
//! `--data` options of `autopar run` become the driver's run hooks, and `autopar checkpoint`
//! inspects a checkpoint or exports its weights in Hugging Face's format.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use autopar_driver::checkpoint::{self, Checkpoint, SaveInfo, SaveOptions, hf};
use autopar_driver::data::DataFile;
use autopar_driver::{CompileOptions, CompiledStep, Error};

use crate::print_stdout;

/// The environment variable of the test-only fault hook of saving: `STEP` makes the process
/// abort in the middle of the save after step `STEP` (after its first shard file), as a
/// kill would.
pub const FAULT_SAVE_ENV: &str = "AUTOPAR_FAULT_SAVE";

/// Checkpoint and data options of `autopar run`.
#[derive(clap::Args)]
pub struct CheckpointRunArgs {
    /// Save sharded checkpoints under DIR (as DIR/step-NNNNNNNN, one safetensors file per
    /// rank and an index.json), after every --save-every steps and after the last.
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<String>,
    /// Steps between checkpoints, counted from the start of training [default: only after
    /// the last step].
    #[arg(long, value_name = "K", requires = "checkpoint")]
    pub save_every: Option<u64>,
    /// Keep only the newest N checkpoints under --checkpoint [default: all].
    #[arg(long, value_name = "N", requires = "checkpoint")]
    pub keep: Option<usize>,
    /// Resume from a checkpoint: a step directory, or a --checkpoint directory (its newest
    /// complete checkpoint). Any mesh and plan may resume it; --steps counts from the start
    /// of training, and the seed and data position are the checkpoint's.
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub resume: Option<String>,
    /// Start from Hugging Face weights: a GPT-2 or Llama `model.safetensors`, mapped onto
    /// the zoo's `gpt:` or `llama:` model of the same shape (optimizer state starts fresh).
    #[arg(long, value_name = "FILE")]
    pub init_from: Option<String>,
    /// Feed batches from a safetensors file holding a tensor per input of the step
    /// (`tokens`, `targets`, ...), whole batches stacked along the first dim; step i gets
    /// batch i modulo their number.
    #[arg(long, value_name = "FILE")]
    pub data: Option<String>,
}

/// Where a run starts and what it saves, from [`CheckpointRunArgs`].
pub struct Session {
    /// The seed the run draws from (the checkpoint's when resuming).
    pub seed: u64,
    /// Steps already taken (the checkpoint's).
    pub first_step: u64,
    /// Every rank's initial state, when it is not drawn from the seed.
    pub initial: Option<Vec<autopar_driver::TensorMap>>,
    /// Batches from a file.
    pub data: Option<DataFile>,
    /// Where to save, when asked.
    pub save: Option<SaveTarget>,
}

/// Where and how often a run saves.
pub struct SaveTarget {
    root: PathBuf,
    every: Option<u64>,
    keep: Option<usize>,
    model: String,
    plan: checkpoint::PlanRecord,
    initial_loss_scale: Option<f64>,
    forward: bool,
    fault_step: Option<u64>,
}

impl Session {
    /// The session of a run of `step` (compiled from `options`) asked for by `args`; `seed`
    /// is the run's `--seed`, when given.
    pub fn new(
        args: &CheckpointRunArgs,
        options: &CompileOptions,
        step: &CompiledStep,
        seed: Option<u64>,
    ) -> Result<Session> {
        let mut session = Session {
            seed: seed.unwrap_or(0),
            first_step: 0,
            initial: None,
            data: None,
            save: None,
        };
        if let Some(dir) = &args.resume {
            let ckpt = Checkpoint::open(Path::new(dir))?;
            if let Some(s) = seed
                && s != ckpt.index.seed
            {
                bail!(
                    "--seed {s}: the checkpoint `{}` was trained with seed {} (which resuming keeps)",
                    ckpt.dir.display(),
                    ckpt.index.seed
                );
            }
            session.seed = ckpt.index.seed;
            session.first_step = ckpt.index.data_position;
            let states = match options.forward_only {
                // A forward reads the weights of a training checkpoint and leaves the rest.
                true => ckpt.load_subset(&step.state)?,
                false => ckpt.load(&step.state)?,
            };
            eprintln!(
                "resuming from {} (step {})",
                ckpt.dir.display(),
                ckpt.index.step
            );
            session.initial = Some(states);
        }
        if let Some(file) = &args.init_from {
            let weights = step.state.weights(step);
            let (family, given) = hf::load(Path::new(file), &weights)?;
            eprintln!("loaded {} {family:?} weights from {file}", given.len());
            session.initial = Some(
                (0..step.mesh.num_devices())
                    .map(|rank| step.state.init_rank_with(rank, session.seed, &given))
                    .collect::<Result<_, Error>>()?,
            );
        }
        if let Some(file) = &args.data {
            session.data = Some(DataFile::open(Path::new(file), step)?);
        }
        if let Some(root) = &args.checkpoint {
            let fault_step = match std::env::var(FAULT_SAVE_ENV) {
                Ok(v) => Some(
                    v.parse::<u64>()
                        .with_context(|| format!("{FAULT_SAVE_ENV}={v}: not a step number"))?,
                ),
                Err(_) => None,
            };
            session.save = Some(SaveTarget {
                root: PathBuf::from(root),
                every: args.save_every,
                keep: args.keep,
                model: options.model.clone(),
                plan: checkpoint::plan_record(options, step),
                initial_loss_scale: options.train.loss_scaling.map(|l| l.initial_scale),
                forward: options.forward_only,
                fault_step,
            });
        }
        Ok(session)
    }

    /// How many steps to run for `--steps total` (counted from the start of training).
    pub fn steps_to_run(&self, total: u64) -> Result<u64> {
        if self.first_step > 0 && total <= self.first_step {
            bail!(
                "--steps {total}: the checkpoint has taken {} steps already (--steps counts from \
                 the start of training)",
                self.first_step
            );
        }
        Ok(total - self.first_step)
    }
}

impl SaveTarget {
    /// Steps between saves; only the last step when not asked for.
    pub fn every(&self) -> u64 {
        self.every.unwrap_or(u64::MAX)
    }

    /// Saves the state after `done` steps.
    pub fn save(
        &self,
        step: &CompiledStep,
        done: u64,
        seed: u64,
        first_step: u64,
        states: &[autopar_driver::TensorMap],
    ) -> Result<(), Error> {
        // A forward takes no step: its checkpoint is of the state it read.
        let taken = if self.forward { first_step } else { done };
        let info = SaveInfo {
            step: taken,
            seed,
            model: self.model.clone(),
            plan: self.plan.clone(),
            initial_loss_scale: self.initial_loss_scale,
        };
        let options = SaveOptions {
            keep: self.keep,
            crash_after_files: (self.fault_step == Some(taken)).then_some(1),
        };
        let dir = checkpoint::save(&self.root, &step.state, states, &info, &options)?;
        eprintln!("saved checkpoint {}", dir.display());
        Ok(())
    }
}

/// `autopar checkpoint`.
#[derive(clap::Args)]
pub struct CheckpointArgs {
    #[command(subcommand)]
    command: CheckpointCommand,
}

#[derive(clap::Subcommand)]
enum CheckpointCommand {
    /// List a checkpoint's tensors with their dtypes, shapes and shards, its files and the
    /// plan it was saved under.
    Inspect {
        /// A checkpoint directory, or a --checkpoint root (its newest checkpoint).
        dir: String,
        /// Print the index as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a checkpoint's weights in another format.
    Export {
        /// A checkpoint directory, or a --checkpoint root (its newest checkpoint).
        dir: String,
        /// Output format: `hf` (a Hugging Face GPT-2 or Llama model.safetensors).
        #[arg(long, value_enum)]
        format: ExportFormat,
        /// The output file.
        #[arg(short, long, value_name = "FILE")]
        output: String,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExportFormat {
    /// Hugging Face safetensors, named as `transformers` saves GPT-2 and Llama.
    Hf,
}

/// Runs `autopar checkpoint`.
pub fn run(args: &CheckpointArgs) -> Result<()> {
    match &args.command {
        CheckpointCommand::Inspect { dir, json } => {
            let ckpt = Checkpoint::open(Path::new(dir))?;
            let text = match json {
                true => serde_json::to_string_pretty(&ckpt.index)? + "\n",
                false => describe(&ckpt),
            };
            print_stdout(&text)
        }
        CheckpointCommand::Export {
            dir,
            format: ExportFormat::Hf,
            output,
        } => {
            let ckpt = Checkpoint::open(Path::new(dir))?;
            let names: Vec<&str> = ckpt.index.tensors.iter().map(|t| t.name.as_str()).collect();
            let family = hf::family_of_zoo(&names).with_context(|| {
                format!(
                    "{}: neither a GPT-2 nor a Llama model's checkpoint (no `wte`/`wpe` or \
                     `tok_embeddings`)",
                    ckpt.dir.display()
                )
            })?;
            let weights = names
                .iter()
                .filter(|n| !n.contains(':'))
                .map(|&n| Ok((n.to_string(), ckpt.tensor(n)?)))
                .collect::<Result<_, Error>>()?;
            let tensors = hf::export(family, &weights)?;
            hf::write(Path::new(output), &tensors)?;
            print_stdout(&format!(
                "wrote {} {family:?} tensors to {output}\n",
                tensors.len()
            ))
        }
    }
}

/// The human-readable description of a checkpoint.
fn describe(ckpt: &Checkpoint) -> String {
    let i = &ckpt.index;
    let mut out = String::new();
    let _ = writeln!(out, "checkpoint: {}", ckpt.dir.display());
    let scale = i.loss_scale.map_or("-".into(), |s| s.to_string());
    let _ = writeln!(
        out,
        "step: {}  seed: {}  data position: {}  loss scale: {scale}",
        i.step, i.seed, i.data_position
    );
    let _ = writeln!(out, "model: {}", i.model);
    let mesh = i.plan.mesh.as_deref().unwrap_or("one device");
    let _ = writeln!(
        out,
        "plan: {mesh} ({} ranks) {}",
        i.plan.ranks, i.plan.options
    );
    let bytes: u64 = i.files.iter().map(|f| f.bytes).sum();
    let _ = writeln!(out, "files: {} ({bytes} bytes)", i.files.len());
    for f in &i.files {
        let _ = writeln!(
            out,
            "  {}  {} bytes  rank {}  sha256 {}",
            f.name, f.bytes, f.rank, f.sha256
        );
    }
    let width = i
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let _ = writeln!(out, "{:width$}  dtype  shape  shards", "tensor");
    for t in &i.tensors {
        let shards: Vec<String> = t
            .shards
            .iter()
            .map(|s| {
                let region: Vec<String> =
                    s.region.iter().map(|[a, b]| format!("{a}..{b}")).collect();
                let ranks: Vec<String> = s.ranks.iter().map(usize::to_string).collect();
                format!(
                    "[{}] {} (ranks {})",
                    region.join(", "),
                    s.file,
                    ranks.join(",")
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "{:width$}  {:5}  {:?}  {}: {}",
            t.name,
            t.dtype,
            t.shape,
            t.shards.len(),
            shards.join(" | ")
        );
    }
    out
}
