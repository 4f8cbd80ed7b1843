//! autopar as a library: compile gpt-tiny for data and tensor parallelism over four CPU
//! ranks, train two steps and check them against the single-device reference.

use autopar_driver::{CompileOptions, RunOptions, compile, run};

fn main() -> Result<(), autopar_driver::Error> {
    // gpt-tiny on dp=2 x tp=2: the driver builds the training step, shards it and
    // partitions it into one program per rank.
    let options = CompileOptions::new("gpt-tiny").on_mesh("dp=2,tp=2")?;
    let step = compile(&options)?;
    for t in &step.timings {
        println!(
            "{:<12} {:>8.2} ms",
            t.pass.name(),
            t.wall.as_secs_f64() * 1e3
        );
    }

    // Two steps on one thread per rank, the reference running beside them.
    let two_steps = RunOptions {
        steps: 2,
        verify: true,
        ..RunOptions::default()
    };
    let report = run(&step, &two_steps, |e| {
        println!("step {} loss: {:.6}", e.step + 1, e.loss);
    })?;
    let verify = report.verify.expect("asked for");
    println!("{}", verify.line());
    if !verify.ok() {
        std::process::exit(1);
    }
    Ok(())
}
