//! The `autopar` command line: list the model zoo, dump graphs, and run them.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use autopar::frontends::zoo::{self, EntryKind};
use autopar::{DumpFormat, dump, load_model};

/// autopar: an auto-parallel compiler for deep-learning training.
#[derive(Parser)]
#[command(name = "autopar", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the zoo's models and spec families with their parameter counts.
    Models {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Dump a model's graph as text IR (.air), Graphviz DOT or JSON.
    Dump {
        /// A zoo name, a spec (gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256), or a .air/.json file.
        model: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// Write to this file instead of standard output.
        #[arg(short, long, value_name = "FILE")]
        output: Option<String>,
        /// Batch size for zoo models [default: 8].
        #[arg(long)]
        batch: Option<usize>,
    },
    /// Run a model on the reference interpreter.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// A zoo name, a spec, or a .air/.json file.
    model: String,
    /// Run one forward pass and print the loss.
    #[arg(long)]
    forward: bool,
    /// Batch size for zoo models [default: 8].
    #[arg(long)]
    batch: Option<usize>,
    /// Seed of the parameter initialisation and the synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Dot,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match execute(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn execute(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Models { json } => models(json),
        Command::Dump {
            model,
            format,
            output,
            batch,
        } => {
            let g = load_model(&model, batch)?;
            let format = match format {
                Format::Text => DumpFormat::Text,
                Format::Dot => DumpFormat::Dot,
                Format::Json => DumpFormat::Json,
            };
            let text = dump(&g, format);
            match output {
                Some(path) => {
                    std::fs::write(&path, text).with_context(|| format!("cannot write `{path}`"))
                }
                None => print_stdout(&text),
            }
        }
        Command::Run(args) => run(args),
    }
}

fn models(json: bool) -> Result<()> {
    let mut rows = Vec::new();
    for e in zoo::entries() {
        let params = match e.kind {
            EntryKind::Preset => Some(zoo::resolve(e.name)?.num_parameters()),
            EntryKind::Family => None,
        };
        rows.push((e, params));
    }
    if json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|(e, p)| {
                serde_json::json!({
                    "name": e.name,
                    "kind": match e.kind { EntryKind::Preset => "model", EntryKind::Family => "spec" },
                    "parameters": p,
                    "description": e.description,
                })
            })
            .collect();
        return print_stdout(&(serde_json::to_string_pretty(&list)? + "\n"));
    }
    let models: Vec<_> = rows
        .iter()
        .filter(|(e, _)| e.kind == EntryKind::Preset)
        .collect();
    let width = models
        .iter()
        .map(|(e, _)| e.name.len())
        .max()
        .unwrap_or(0)
        .max(5);
    let mut out = format!(
        "{:<width$}  {:>16}  {:>7}  DESCRIPTION\n",
        "MODEL", "PARAMETERS", ""
    );
    for (e, p) in &models {
        let n = p.unwrap_or(0);
        out += &format!(
            "{:<width$}  {:>16}  {:>7}  {}\n",
            e.name,
            group_digits(n),
            human_count(n),
            e.description
        );
    }
    out += "\nGeneric specs (also: a zoo name with overrides, e.g. llama3-8b:seq=4096):\n";
    for (e, _) in rows.iter().filter(|(e, _)| e.kind == EntryKind::Family) {
        out += &format!("  {}\n      {}\n", e.name, e.description);
    }
    print_stdout(&out)
}

fn run(args: RunArgs) -> Result<()> {
    if !args.forward {
        anyhow::bail!("`autopar run` executes forward passes only for now: pass --forward");
    }
    let g = load_model(&args.model, args.batch)?;
    let loss = autopar::forward_loss(&g, args.seed)?;
    print_stdout(&format!("loss: {loss:.6}\n"))
}

/// Writes to stdout, treating a closed pipe (`autopar dump ... | head`) as success.
fn print_stdout(s: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("cannot write to standard output"),
    }
}

/// `174604259328` → `174,604,259,328`.
fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `174604259328` → `174.6B`.
fn human_count(n: u64) -> String {
    let x = n as f64;
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", x / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1}M", x / 1e6),
        _ => format!("{:.1}B", x / 1e9),
    }
}
