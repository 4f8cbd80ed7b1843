//! NCCL's bootstrap over MPI: every rank of a 2-process job gets the unique id rank 0 made,
//! and without libnccl every rank gets an error instead of a panic.
//!
//! Run as a test, the binary finds the `nvidia-nccl-cu13` wheel's `libnccl.so.2`
//! (`AUTOPAR_NCCL_LIB_DIR`, or the `nvidia.nccl` Python package), links it as `libnccl.so` in
//! a scratch directory, and starts itself under `mpirun -np 2` twice: with that directory on
//! `LD_LIBRARY_PATH` (the ids must agree), and with an empty one (every rank must fail
//! cleanly).

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use autopar_ir::{DType, DeviceMesh, TensorType};
use autopar_runtime::comm::mpi::{finalize, started_by_mpirun};
use autopar_runtime::comm::nccl::nccl_unique_id;
use autopar_runtime::{CommOptions, Launcher, MpiLauncher, Tensor, root_cause};

/// What the processes are to check: `present` or `absent`.
const EXPECT: &str = "AUTOPAR_NCCL_EXPECT";

fn main() -> ExitCode {
    if started_by_mpirun() {
        return match std::env::var(EXPECT).as_deref() {
            Ok("absent") => process_without_nccl(),
            _ => process_with_nccl(),
        };
    }
    let Some(lib) = wheel_lib_dir() else {
        eprintln!(
            "nccl_bootstrap: no libnccl.so.2 (install nvidia-nccl-cu13 or set AUTOPAR_NCCL_LIB_DIR)"
        );
        return ExitCode::FAILURE;
    };
    let scratch = std::env::temp_dir().join(format!("autopar-nccl-{}", std::process::id()));
    let with = scratch.join("with");
    let without = scratch.join("without");
    for d in [&with, &without] {
        if let Err(e) = std::fs::create_dir_all(d) {
            eprintln!("nccl_bootstrap: cannot create {}: {e}", d.display());
            return ExitCode::FAILURE;
        }
    }
    let link = with.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    if let Err(e) = std::os::unix::fs::symlink(lib.join("libnccl.so.2"), &link) {
        eprintln!("nccl_bootstrap: cannot link {}: {e}", link.display());
        return ExitCode::FAILURE;
    }
    let mut ok = true;
    for (dir, expect) in [(&with, "present"), (&without, "absent")] {
        let status = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
            .args(["-x", "LD_LIBRARY_PATH", "-x", EXPECT])
            .arg(std::env::current_exe().expect("this test's binary"))
            .env("LD_LIBRARY_PATH", dir)
            .env(EXPECT, expect)
            .status();
        match status {
            Ok(s) if s.success() => println!("nccl_bootstrap: libnccl {expect}: ok"),
            other => {
                eprintln!("nccl_bootstrap: libnccl {expect}: {other:?}");
                ok = false;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn wheel_lib_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("AUTOPAR_NCCL_LIB_DIR") {
        return Some(PathBuf::from(d));
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))",
        ])
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    dir.join("libnccl.so.2").exists().then_some(dir)
}

/// Both ranks get an id, and it is the same: gathered over MPI and compared.
fn process_with_nccl() -> ExitCode {
    let id = match nccl_unique_id() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("nccl_bootstrap: {e}");
            return ExitCode::FAILURE;
        }
    };
    let bytes: Vec<i64> = id.internal().iter().map(|&c| i64::from(c as u8)).collect();
    assert!(bytes.iter().any(|&b| b != 0), "an all-zero id");
    let mesh = DeviceMesh::new([("x", 2)]).expect("mesh");
    let launcher = MpiLauncher::new(CommOptions::default());
    let results = launcher
        .launch(&mesh, |comm| {
            let x = Tensor::from_i64(TensorType::new(DType::I64, [1, bytes.len()]), bytes.clone())?;
            comm.all_gather(&x, &["x".to_string()], 0)
        })
        .expect("the ranks start");
    let ids = root_cause(results).expect("the ranks gather");
    let all = ids[0].1.ints().expect("integers").to_vec();
    let (a, b) = all.split_at(all.len() / 2);
    finalize();
    if a == b && a == &bytes[..] {
        ExitCode::SUCCESS
    } else {
        eprintln!("nccl_bootstrap: the ranks hold different ids");
        ExitCode::FAILURE
    }
}

/// Without libnccl, every rank gets the same clear error.
fn process_without_nccl() -> ExitCode {
    let outcome = nccl_unique_id();
    finalize();
    match outcome {
        Err(e) if e.to_string().contains("cannot load libnccl") => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl_bootstrap: unexpected error {e}");
            ExitCode::FAILURE
        }
        Ok(_) => {
            eprintln!("nccl_bootstrap: an id without libnccl");
            ExitCode::FAILURE
        }
    }
}
