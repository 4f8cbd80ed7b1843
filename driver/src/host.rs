//! The memory of the machine a CPU run executes on, compared before the run with what the
//! compiled step's ranks will hold, so that a step too large for the machine is refused with
//! both numbers instead of allocating until the operating system kills the process.

use crate::{CompiledStep, Error};

/// Bytes the operating system reports as available to a new allocation (`MemAvailable` in
/// `/proc/meminfo`), or `None` where it does not say.
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// A lower bound on the bytes every rank of `step` holds at once when all its ranks run in
/// this process: per rank, the larger of its planned peak (parameters, inputs and the live
/// tensors of its program) and the state it keeps between steps; saturating.
pub fn planned_bytes(step: &CompiledStep) -> u64 {
    let ranks = step.mesh.num_devices();
    (0..ranks)
        .map(|rank| {
            let state = step.state.rank_bytes(rank);
            let program = match step.pipeline {
                None => step.plans.get(rank).map_or(0, |p| p.peak_bytes()),
                Some(_) => 0,
            };
            state.max(program)
        })
        .fold(0u64, u64::saturating_add)
}

/// Refuses to run `step` when its ranks need more memory than `available` bytes (when the
/// machine reports it).
pub fn check_fits(step: &CompiledStep, available: Option<u64>) -> Result<(), Error> {
    let Some(available) = available else {
        return Ok(());
    };
    let needed = planned_bytes(step);
    if needed > available {
        return Err(Error::HostMemory {
            needed,
            available,
            ranks: step.mesh.num_devices(),
        });
    }
    Ok(())
}

/// `bytes` for people: `1.5 GiB`, `12.0 KiB`, `512 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available() {
        let text = "MemTotal:       16318320 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(12_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
    }

    #[test]
    fn bytes_for_people() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(2008072), "1.9 MiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
    }
}
