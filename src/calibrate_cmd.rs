//! `autopar calibrate`: the calibration report on the command line. Reads every table of the
//! reference directory (`../shared/reference` by default), has the cost model estimate each
//! row it can express (`autopar_cost_model::calibrate`), and prints per-table and overall
//! errors against the measurements, as text or JSON.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use autopar_cost_model::calibrate;

/// Arguments of `autopar calibrate`.
#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// Print the report as JSON (every row included).
    #[arg(long)]
    json: bool,
    /// Only this table (its file name, with or without `.csv`).
    #[arg(long, value_name = "NAME")]
    table: Option<String>,
    /// The directory of reference tables.
    #[arg(long, value_name = "DIR", default_value = "../shared/reference")]
    reference: PathBuf,
    /// Print every estimated row under its table.
    #[arg(long)]
    rows: bool,
}

/// Runs `autopar calibrate`.
pub fn calibrate_cmd(args: CalibrateArgs) -> Result<()> {
    let dir = &args.reference;
    if !dir.is_dir() {
        bail!(
            "no reference directory at `{}` (give it with --reference DIR; by default \
             ../shared/reference, relative to the current directory)",
            dir.display()
        );
    }
    let mut tables = Vec::new();
    for entry in
        std::fs::read_dir(dir).with_context(|| format!("cannot read `{}`", dir.display()))?
    {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "csv") {
            continue;
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read `{}`", path.display()))?;
        tables.push((name, text));
    }
    tables.sort();
    if let Some(want) = &args.table {
        let want = want.strip_suffix(".csv").unwrap_or(want);
        tables.retain(|(name, _)| name.strip_suffix(".csv").unwrap_or(name) == want);
        if tables.is_empty() {
            bail!("no table `{want}.csv` in `{}`", dir.display());
        }
    }
    if tables.is_empty() {
        bail!("no .csv table in `{}`", dir.display());
    }
    let report = calibrate(&tables);
    if args.json {
        return crate::print_stdout(&(serde_json::to_string_pretty(&report)? + "\n"));
    }
    crate::print_stdout(&report.render(args.rows))
}
