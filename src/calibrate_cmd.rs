//! `autopar calibrate`: the calibration report on the command line. Reads every table of the
//! reference directory (`../shared/reference` by default), or one table file, has the cost
//! model estimate each row it can express (`autopar_cost_model::calibrate`), and prints
//! per-table and overall errors against the measurements, as text or JSON; `--published` adds
//! the published runs outside the reference tables that the crate embeds. A table of one's own
//! runs (`calibrate::RUN_COLUMNS`) has its model and cluster arguments resolved here, as
//! `autopar estimate` resolves them.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use autopar_cost_model::calibrate::{Resolver, calibrate, calibrate_with, published_tables};
use autopar_cost_model::{Cluster, TransformerConfig};
use autopar_driver as driver;

/// Arguments of `autopar calibrate`.
#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// Print the report as JSON (every row included).
    #[arg(long)]
    json: bool,
    /// Only this table (its file name, with or without `.csv`).
    #[arg(long, value_name = "NAME")]
    table: Option<String>,
    /// The directory of reference tables, or one table file. Besides the reference tables
    /// this reads tables of one's own runs, whatever their name: CSV with the columns
    /// `model`, `cluster`, `plan` (as `autopar estimate` takes them, the global batch as
    /// `gbs=` in the plan or in a `batch` column), optionally `software` and `label`, and one
    /// measurement per row: `step_s`, `tokens_per_s_per_gpu` or `tokens_per_s`.
    #[arg(long, value_name = "DIR|FILE", default_value = "../shared/reference")]
    reference: PathBuf,
    /// Print every estimated row under its table.
    #[arg(long)]
    rows: bool,
    /// Add the published runs outside the reference tables (NeMo 24.07's and 24.05's fp8 tables,
    /// NeMo 24.03's long-sequence context-parallel runs, Megatron-Bridge's fp8 Llama and Qwen3-235B-A22B runs, Megatron-LM's Llama 3 fp8 examples, Megatron-Core's
    /// strong scaling, Llama 3 405B, torchtitan's Llama 3.1 benchmarks),
    /// embedded in the binary.
    #[arg(long)]
    published: bool,
}

/// Resolves a table of runs' model and cluster arguments as `autopar estimate` does: zoo
/// models, specs and graph files; presets and cluster files (paths relative to the current
/// directory).
struct ZooAndFiles;

impl Resolver for ZooAndFiles {
    fn model(&self, spec: &str) -> Result<TransformerConfig, String> {
        driver::model_config(spec).map_err(|e| e.to_string())
    }

    fn cluster(&self, spec: &str) -> Result<Cluster, String> {
        driver::load_cluster(spec).map_err(|e| e.to_string())
    }
}

/// A table file as `calibrate` takes it: its file name and its text.
fn read_table(path: &std::path::Path) -> Result<(String, String)> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read `{}`", path.display()))?;
    Ok((name, text))
}

/// Runs `autopar calibrate`.
pub fn calibrate_cmd(args: CalibrateArgs) -> Result<()> {
    let dir = &args.reference;
    let mut tables = Vec::new();
    if dir.is_file() {
        tables.push(read_table(dir)?);
    } else if dir.is_dir() {
        for entry in
            std::fs::read_dir(dir).with_context(|| format!("cannot read `{}`", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "csv") {
                continue;
            }
            tables.push(read_table(&path)?);
        }
    } else if !args.published {
        bail!(
            "no reference directory at `{}` (give it with --reference DIR; by default \
             ../shared/reference, relative to the current directory; --published reports the \
             embedded published runs without it)",
            dir.display()
        );
    }
    tables.sort();
    let mut published = match args.published {
        true => published_tables(),
        false => Vec::new(),
    };
    if let Some(want) = &args.table {
        let want = want.strip_suffix(".csv").unwrap_or(want);
        let keep = |(name, _): &(String, String)| name.strip_suffix(".csv").unwrap_or(name) == want;
        tables.retain(keep);
        published.retain(keep);
        if tables.is_empty() && published.is_empty() {
            bail!(
                "no table `{want}.csv` in `{}`{}",
                dir.display(),
                if args.published {
                    " or among the published runs"
                } else {
                    ""
                }
            );
        }
    }
    if tables.is_empty() && published.is_empty() {
        bail!("no .csv table in `{}`", dir.display());
    }
    // The reference tables and the published runs are summarised apart: the first are what
    // the model is calibrated on, the second a check beyond them.
    let report = (!tables.is_empty()).then(|| calibrate_with(&tables, &ZooAndFiles));
    let beyond = (!published.is_empty()).then(|| calibrate(&published));
    if args.json {
        let value = match (&report, &beyond, args.published) {
            (Some(r), _, false) => serde_json::to_value(r)?,
            (r, b, _) => serde_json::json!({ "reference": r, "published": b }),
        };
        return crate::print_stdout(&(serde_json::to_string_pretty(&value)? + "\n"));
    }
    let mut out = String::new();
    if let Some(r) = &report {
        out += &r.render(args.rows);
    }
    if let Some(b) = &beyond {
        if report.is_some() {
            out += "\n";
        }
        out += "published runs outside the reference tables\n";
        out += &b.render(args.rows);
    }
    crate::print_stdout(&out)
}
