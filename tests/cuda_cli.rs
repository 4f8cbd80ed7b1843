//! `autopar run --device cuda` on the command line: where the CUDA libraries or a GPU are
//! missing (CI, this project's build machines), it exits 1 with one line naming what is
//! missing, without a panic; where they are all there, it trains and verifies.

mod common;

use common::autopar;

#[test]
fn device_cuda_runs_or_names_what_is_missing() {
    let found = autopar_driver::runtime_cuda::discover();
    let out = autopar(&["run", "gpt-tiny", "--device", "cuda", "--steps", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match found.require_runnable() {
        Ok(()) => assert!(out.status.success(), "{stderr}"),
        Err(missing) => {
            assert_eq!(out.status.code(), Some(1), "{stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            assert_eq!(lines.len(), 1, "not one line: {stderr}");
            assert!(
                lines[0].contains(&missing.to_string()),
                "{stderr} vs {missing}"
            );
            assert!(
                lines[0].contains(".so") || lines[0].contains("GPU"),
                "the error names no library or GPU: {stderr}"
            );
        }
    }
}

#[test]
fn device_cuda_refuses_pipelines_and_unknown_devices() {
    let out = autopar(&["run", "gpt-tiny", "--device", "tpu"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Refused before any CUDA library is loaded, so the same on every machine.
    let out = autopar(&[
        "run",
        "gpt-tiny",
        "--device",
        "cuda",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("pipelines"), "{stderr}");
}
