//! `autopar report` and `autopar run --report`: the two reports the issue asks for are single
//! files under 2 MB with no external reference, their pictures have the expected elements
//! (GPUs drawn, pipeline ranks, memory bars), their numbers are `estimate --json`'s and
//! `plan --json`'s, and headless Chromium (when installed) renders them without a console
//! error. Every external process is bounded by a timeout.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

use common::GPT3;

const LLAMA: [&str; 6] = [
    "llama3-70b",
    "--cluster",
    "dgx-h100:nodes=8",
    "--batch",
    "512",
    "--top=5",
];

fn out_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-test");
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// What a bounded process left: exit success, stdout, stderr.
struct Output {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Runs `program args`, killing it after `limit`; stdout and stderr go through files so that
/// a large output cannot block the child while we wait.
fn run_bounded(program: &str, args: &[&str], limit: Duration, tag: &str) -> Output {
    let dir = out_dir();
    let (out_path, err_path) = (
        dir.join(format!("{tag}.stdout")),
        dir.join(format!("{tag}.stderr")),
    );
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for the child") {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`{program} {}` ran past {limit:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        ok: status.success(),
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    }
}

fn autopar(args: &[&str], tag: &str) -> Output {
    run_bounded(
        env!("CARGO_BIN_EXE_autopar"),
        args,
        Duration::from_secs(300),
        tag,
    )
}

/// Writes a report (once per test binary) and returns its path and text.
fn report(which: &'static str) -> &'static (PathBuf, String) {
    static LLAMA_REPORT: OnceLock<(PathBuf, String)> = OnceLock::new();
    static GPT3_REPORT: OnceLock<(PathBuf, String)> = OnceLock::new();
    let (cell, args): (_, &[&str]) = match which {
        "llama" => (&LLAMA_REPORT, &LLAMA),
        _ => (&GPT3_REPORT, &GPT3),
    };
    cell.get_or_init(|| {
        let path = out_dir().join(format!("{which}.html"));
        let path_text = path.to_str().expect("a UTF-8 path").to_string();
        let mut a = vec!["report"];
        a.extend_from_slice(args);
        a.extend(["-o", &path_text]);
        let o = autopar(&a, &format!("report-{which}"));
        assert!(o.ok, "autopar report failed: {}", o.stderr);
        let text = std::fs::read_to_string(&path).expect("the report is written");
        (path, text)
    })
}

/// The `<svg>` element whose class is `class`.
fn svg_of<'a>(html: &'a str, class: &str) -> &'a str {
    let key = "<svg viewBox=";
    for (i, _) in html.match_indices(key) {
        let end = html[i..].find("</svg>").map_or(html.len(), |e| i + e + 6);
        let head_end = html[i..].find('>').map_or(end, |e| i + e);
        if html[i..head_end].contains(&format!("class=\"{class}\"")) {
            return &html[i..end];
        }
    }
    panic!("no <svg class=\"{class}\">");
}

fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

/// The embedded `report-data` JSON.
fn data(html: &str) -> Value {
    let start = html
        .find("id=\"report-data\">")
        .expect("a report-data block")
        + "id=\"report-data\">".len();
    let end = start + html[start..].find("</script>").expect("its end");
    serde_json::from_str(&html[start..end].replace("<\\/", "</")).expect("report data is JSON")
}

fn assert_self_contained(html: &str) {
    for forbidden in ["http", "<script src", "@import", "url(", "<link", "<img"] {
        assert!(
            !html.contains(forbidden),
            "the report refers outside itself: `{forbidden}`"
        );
    }
    assert_eq!(
        count(html, "<script"),
        1,
        "only the inert JSON data block is a script"
    );
    assert!(html.contains("<script type=\"application/json\" id=\"report-data\">"));
}

/// Checks the element counts of a page (the written file or Chromium's DOM of it).
fn assert_counts(html: &str, gpus: usize, nodes_full: usize, cells: usize, pp: usize) {
    let topo = svg_of(html, "topology");
    assert_eq!(count(topo, "class=\"gpu\""), gpus, "GPUs drawn");
    assert_eq!(
        count(topo, "class=\"node-full\""),
        nodes_full,
        "nodes in full"
    );
    assert_eq!(count(topo, "class=\"node-cell\""), cells, "summary squares");
    let tl = svg_of(html, "timeline-predicted");
    assert_eq!(count(tl, "class=\"pp-rank\""), pp, "pipeline ranks");
    let mem = svg_of(html, "memory");
    assert_eq!(count(mem, "class=\"mem-bar\""), pp, "memory bars");
    // Each bar has at least weights, gradients, optimizer state and activations.
    assert!(count(mem, "class=\"mem-seg ") >= 4 * pp);
}

#[test]
fn the_two_reports_are_small_self_contained_and_draw_what_they_should() {
    let (_, llama) = report("llama");
    let (_, gpt3) = report("gpt3");
    for html in [llama, gpt3] {
        assert!(html.len() < 2 << 20, "{} bytes", html.len());
        assert_self_contained(html);
    }
    // 8 nodes of 8: every GPU drawn; the plan's pp=4 gives four rows and four bars.
    let pp = data(llama)["config"]["pp"].as_u64().expect("pp") as usize;
    assert_counts(llama, 64, 8, 0, pp);
    // 128 nodes: node 0 in full, every node a square, 16 pipeline ranks.
    assert_counts(gpt3, 8, 1, 128, 16);
    assert!(gpt3.contains("the other 127 repeat its pattern"));
    // The counts embedded in the data agree with the elements.
    let c = &data(gpt3)["counts"];
    assert_eq!(c["gpus_drawn"], 8);
    assert_eq!(c["pipeline_ranks"], 16);
    assert_eq!(c["memory_bars"], 16);
    // The bubble fraction is written on the timeline, every axis has a legend entry.
    for axis in ["pp=16", "dp=8", "tp=8"] {
        assert!(gpt3.contains(&format!("<b>{axis}</b>")), "{axis}");
    }
    assert!(svg_of(gpt3, "timeline-predicted").contains("% of the pipeline"));
    assert!(gpt3.contains("class=\"coll-row\""));
}

#[test]
fn the_numbers_are_those_of_estimate_and_plan_json() {
    // The plan given: `estimate --json` for the same inputs.
    let mut args = vec!["estimate"];
    args.extend_from_slice(&GPT3);
    args.push("--json");
    let o = autopar(&args, "estimate-gpt3");
    assert!(o.ok, "{}", o.stderr);
    let est: Value = serde_json::from_str(&o.stdout).expect("estimate JSON");
    let d = data(&report("gpt3").1);
    for key in [
        "iter_time_s",
        "tokens_per_s",
        "mfu",
        "model_tflops_per_gpu",
        "peak_memory_gib",
    ] {
        assert_eq!(d[key], est[key], "{key}");
    }
    assert_eq!(d["time"], est["time"]);
    assert_eq!(
        d["memory_per_pipeline_rank"],
        est["memory_per_pipeline_rank"]
    );
    let t = &est["time"];
    let bubble =
        t["bubble_s"].as_f64().expect("bubble") / t["pipeline_s"].as_f64().expect("pipeline");
    assert_eq!(d["bubble_fraction"].as_f64(), Some(bubble));

    // The search: `plan --json` ranks the same plans with the same numbers.
    let mut args = vec!["plan"];
    args.extend_from_slice(&LLAMA);
    args.push("--json");
    let o = autopar(&args, "plan-llama");
    assert!(o.ok, "{}", o.stderr);
    let plan: Value = serde_json::from_str(&o.stdout).expect("plan JSON");
    let html = &report("llama").1;
    let d = data(html);
    let ours = d["plans"].as_array().expect("plans");
    let theirs = plan["plans"].as_array().expect("plans");
    assert_eq!(ours.len(), theirs.len());
    assert!(!ours.is_empty());
    for (a, b) in ours.iter().zip(theirs) {
        assert_eq!(a["plan"], b["plan"]);
        for key in ["iter_time_s", "tokens_per_s", "mfu", "peak_memory_gib"] {
            assert_eq!(a[key], b["estimate"][key], "{key} of {}", a["plan"]);
        }
        // The table rows carry the same figures.
        let row = format!(
            "data-plan=\"{}\" data-iter-time-s=\"{}\"",
            a["plan"].as_str().expect("a plan"),
            b["estimate"]["iter_time_s"]
        );
        assert!(html.contains(&row), "{row}");
    }
    assert_eq!(d["plan"], theirs[0]["plan"]);
    assert_eq!(d["config"], theirs[0]["config"]);
    assert_eq!(d["iter_time_s"], theirs[0]["estimate"]["iter_time_s"]);
}

/// `report` prices what `plan` and `estimate` price: the same software profile, bucket size
/// and fp8, named on the page; and the search it runs ranks the plans `plan` ranks under them.
#[test]
fn the_report_is_priced_for_the_stack_and_dtype_given() {
    let stack = [
        "--software",
        "megatron-core,tp_comm_overlap=true",
        "--bucket-mb",
        "40",
        "--dtype",
        "fp8",
    ];
    let common = [
        "llama3-70b",
        "--cluster",
        "dgx-h100:nodes=4",
        "--batch",
        "64",
    ];
    let pins = "tp=4,pp=4,vpp=5,mbs=1,zero=1,sp=true";
    let path = out_dir().join("stack.html");
    let path_text = path.to_str().expect("a UTF-8 path").to_string();
    let mut args = vec!["report"];
    args.extend_from_slice(&common);
    args.extend_from_slice(&stack);
    args.extend(["--pin", pins, "--top=3", "-o", &path_text]);
    let o = autopar(&args, "report-stack");
    assert!(o.ok, "{}", o.stderr);
    let html = std::fs::read_to_string(&path).expect("the report is written");
    let d = data(&html);
    assert_eq!(
        d["software"],
        "megatron-core,bucket_mb=40.0,tp_backward_overlap=true,tp_forward_overlap=true",
        "{}",
        d["software"]
    );
    assert!(html.contains("priced for the <code>megatron-core,"));
    assert!(
        d["plan"].as_str().expect("a plan").contains("dtype=fp8"),
        "{}",
        d["plan"]
    );

    let mut args = vec!["plan"];
    args.extend_from_slice(&common);
    args.extend_from_slice(&stack);
    args.extend(["--pin", pins, "--top=3", "--json"]);
    let o = autopar(&args, "plan-stack");
    assert!(o.ok, "{}", o.stderr);
    let plan: Value = serde_json::from_str(&o.stdout).expect("plan JSON");
    let theirs = &plan["plans"][0];
    assert_eq!(d["plan"], theirs["plan"]);
    assert_eq!(d["iter_time_s"], theirs["estimate"]["iter_time_s"]);
    assert_eq!(plan["software"], d["software"]);

    // The `plan --json` document names its stack, so a report of its plan needs no flags.
    let doc = out_dir().join("stack-plan.json");
    std::fs::write(&doc, &o.stdout).expect("the plan document is written");
    let from_doc = out_dir().join("from-doc.html");
    let from_doc_text = from_doc.to_str().expect("a UTF-8 path").to_string();
    let mut args = vec!["report"];
    args.extend_from_slice(&common);
    args.extend([
        "--plan-file",
        doc.to_str().expect("a UTF-8 path"),
        "-o",
        &from_doc_text,
    ]);
    let o = autopar(&args, "report-from-doc");
    assert!(o.ok, "{}", o.stderr);
    let f = data(&std::fs::read_to_string(&from_doc).expect("the report is written"));
    assert_eq!(f["software"], d["software"]);
    assert_eq!(f["iter_time_s"], d["iter_time_s"]);

    // Without the flags the same plan is priced for this project's own stack in bf16: a
    // different step.
    let mut args = vec!["report"];
    args.extend_from_slice(&common);
    let given = d["plan"]
        .as_str()
        .expect("a plan")
        .replace("dtype=fp8", "dtype=bf16");
    let plain = out_dir().join("plain.html");
    let plain_text = plain.to_str().expect("a UTF-8 path").to_string();
    args.extend(["--plan", &given, "-o", &plain_text]);
    let o = autopar(&args, "report-plain");
    assert!(o.ok, "{}", o.stderr);
    let p = data(&std::fs::read_to_string(&plain).expect("the report is written"));
    assert_eq!(p["software"], "autopar");
    assert_ne!(p["iter_time_s"], d["iter_time_s"]);
}

#[test]
fn run_report_puts_the_measured_timeline_beside_the_predicted_one() {
    let dir = out_dir();
    let pp = dir.join("run-pp.html");
    let o = autopar(
        &[
            "run",
            "gpt-tiny",
            "--mesh",
            "pp=2",
            "--micro-batches",
            "4",
            "--report",
            pp.to_str().expect("path"),
        ],
        "run-pp",
    );
    assert!(o.ok, "{}", o.stderr);
    let html = std::fs::read_to_string(&pp).expect("the run report");
    assert_self_contained(&html);
    assert_eq!(
        count(svg_of(&html, "timeline-measured"), "class=\"pp-rank\""),
        2
    );
    assert_eq!(
        count(svg_of(&html, "timeline-predicted"), "class=\"pp-rank\""),
        2
    );
    assert!(count(svg_of(&html, "memory"), "class=\"measured-peak\"") == 2);
    let d = data(&html);
    assert_eq!(d["measured"]["pipelines"], 1);
    assert_eq!(d["cluster"], "cpu:ranks=2");

    // Without a pipeline the page says so and compares each rank's peak instead.
    let spmd = dir.join("run-spmd.html");
    let o = autopar(
        &[
            "run",
            "gpt-tiny",
            "--mesh",
            "dp=2,tp=2",
            "--report",
            spmd.to_str().expect("path"),
        ],
        "run-spmd",
    );
    assert!(o.ok, "{}", o.stderr);
    let html = std::fs::read_to_string(&spmd).expect("the run report");
    assert!(html.contains("The run had no pipeline"));
    assert_eq!(count(&html, "class=\"rank-row\""), 4);
    assert!(!html.contains("timeline-measured"));
}

#[test]
fn report_errors_name_the_option_or_the_file() {
    let o = autopar(
        &[
            "report",
            "gpt3-175b",
            "--cluster",
            "dgx-a100:nodes=2",
            "--batch",
            "16",
            "--plan",
            "dp=x",
            "-o",
            "/dev/null",
        ],
        "bad-plan",
    );
    assert!(!o.ok);
    assert!(
        o.stderr.contains("--plan") && o.stderr.contains("dp"),
        "{}",
        o.stderr
    );
    let o = autopar(
        &[
            "report",
            "gpt-tiny",
            "--cluster",
            "cpu:ranks=2",
            "--batch",
            "8",
            "--plan",
            "dp=2,dtype=f32",
            "-o",
            "/nonexistent-dir/r.html",
        ],
        "bad-output",
    );
    assert!(!o.ok);
    assert!(o.stderr.contains("/nonexistent-dir/r.html"), "{}", o.stderr);
}

/// `chromium` on PATH, if any.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("chromium"))
        .find(|p| p.is_file())
}

#[test]
fn headless_chromium_renders_the_reports_without_console_errors() {
    let Some(browser) = chromium() else {
        eprintln!(
            "skipping the headless Chromium check: `chromium` is not on PATH (.ci/run installs it)"
        );
        return;
    };
    let browser = browser.to_str().expect("a UTF-8 path").to_string();
    let dir = out_dir();
    for (which, gpus, nodes_full, cells) in [("llama", 64, 8, 0), ("gpt3", 8, 1, 128)] {
        let (path, html) = report(which);
        let url = format!("file://{}", path.display());
        let pp = data(html)["config"]["pp"].as_u64().expect("pp") as usize;
        let profile = dir.join(format!("chromium-profile-{which}"));
        let profile_arg = format!("--user-data-dir={}", profile.display());
        let common = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            profile_arg.as_str(),
        ];
        // The DOM after loading, and any console message.
        let mut args: Vec<&str> = common.to_vec();
        args.extend(["--dump-dom", url.as_str()]);
        let o = run_bounded(
            &browser,
            &args,
            Duration::from_secs(60),
            &format!("dom-{which}"),
        );
        assert!(o.ok, "chromium --dump-dom failed: {}", o.stderr);
        let console: Vec<&str> = o
            .stderr
            .lines()
            .filter(|l| l.contains(":CONSOLE"))
            .collect();
        assert!(console.is_empty(), "console messages: {console:#?}");
        assert_counts(&o.stdout, gpus, nodes_full, cells, pp);
        // A screenshot of the whole page.
        let shot = dir.join(format!("{which}.png"));
        let shot_arg = format!("--screenshot={}", shot.display());
        let mut args: Vec<&str> = common.to_vec();
        args.extend([shot_arg.as_str(), "--window-size=1400,3400", url.as_str()]);
        let _ = std::fs::remove_file(&shot);
        let o = run_bounded(
            &browser,
            &args,
            Duration::from_secs(60),
            &format!("shot-{which}"),
        );
        assert!(o.ok, "chromium --screenshot failed: {}", o.stderr);
        let png = std::fs::read(&shot).expect("a screenshot");
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 50_000,
            "{} bytes",
            png.len()
        );
        let console: Vec<&str> = o
            .stderr
            .lines()
            .filter(|l| l.contains(":CONSOLE"))
            .collect();
        assert!(console.is_empty(), "console messages: {console:#?}");
    }
}
