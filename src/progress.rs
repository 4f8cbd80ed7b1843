//! Progress of long commands on standard error: a status line rewritten in place when
//! standard error is a terminal, and otherwise (a log, CI) a line every so often, so that a
//! long search or training run is visibly alive without flooding a log.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How often a command off a terminal prints its progress.
const LOG_EVERY: Duration = Duration::from_secs(30);
/// Environment variable that sets how often, in seconds, a command off a terminal prints
/// its progress.
const PROGRESS_ENV: &str = "AUTOPAR_PROGRESS_EVERY";
/// How often the status line on a terminal is redrawn.
const REDRAW_EVERY: Duration = Duration::from_millis(100);

/// Reports progress on standard error; see the module docs.
pub struct Ticker {
    /// Rewrite one line in place (standard error is a terminal) or print lines.
    live: bool,
    /// Whether anything is shown at all.
    enabled: bool,
    started: Instant,
    last: Option<Instant>,
    every: Duration,
    /// Whether a live line is on the screen (to clear it at the end).
    drawn: bool,
}

impl Ticker {
    /// A ticker that prints a line every `log_every` off a terminal (a status line on one).
    pub fn with_interval(log_every: Duration) -> Ticker {
        let live = std::io::stderr().is_terminal();
        Ticker {
            live,
            enabled: true,
            started: Instant::now(),
            last: None,
            every: if live { REDRAW_EVERY } else { log_every },
            drawn: false,
        }
    }

    /// A ticker with the default interval off a terminal: [`LOG_EVERY`], or the seconds in
    /// `AUTOPAR_PROGRESS_EVERY`.
    pub fn new() -> Ticker {
        let every = std::env::var(PROGRESS_ENV)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map_or(LOG_EVERY, |s| Duration::from_secs_f64(s.min(1e9)));
        Ticker::with_interval(every)
    }

    /// Shows nothing (the command's own output already shows its progress).
    pub fn disabled() -> Ticker {
        Ticker {
            enabled: false,
            ..Ticker::new()
        }
    }

    /// Whether standard error is a terminal.
    pub fn is_live(&self) -> bool {
        self.live
    }

    /// Time since the ticker was made.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Shows `status` if the interval has passed since the last one (or `force`).
    pub fn tick(&mut self, status: impl FnOnce() -> String, force: bool) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        let due = match self.last {
            Some(last) => now.duration_since(last) >= self.every,
            // Off a terminal, the first line waits one interval: short commands print none.
            None => self.live || self.started.elapsed() >= self.every,
        };
        if !due && !force {
            return;
        }
        self.last = Some(now);
        if self.live {
            eprint!("\r\x1b[K{}", status());
            self.drawn = true;
        } else {
            eprintln!("{}", status());
        }
    }

    /// Clears a live status line.
    pub fn finish(&mut self) {
        if self.drawn {
            eprint!("\r\x1b[K");
            self.drawn = false;
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A duration as `1h02m`, `3m05s` or `12s`.
pub fn short_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// The status of a training run after `done` of `total` steps in `elapsed`.
pub fn training_status(done: u64, total: u64, elapsed: Duration, loss: f64) -> String {
    let secs = elapsed.as_secs_f64();
    let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
    let eta = match rate > 0.0 {
        true => short_duration(Duration::from_secs_f64(
            (total.saturating_sub(done) as f64 / rate).min(1e9),
        )),
        false => "?".into(),
    };
    format!("training: step {done}/{total}, {rate:.3} steps/s, loss {loss:.4}, eta {eta}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_statuses_read_well() {
        assert_eq!(short_duration(Duration::from_secs(12)), "12s");
        assert_eq!(short_duration(Duration::from_secs(185)), "3m05s");
        assert_eq!(short_duration(Duration::from_secs(3720)), "1h02m");
        assert_eq!(
            training_status(10, 40, Duration::from_secs(5), 1.23456),
            "training: step 10/40, 2.000 steps/s, loss 1.2346, eta 15s"
        );
        assert!(training_status(0, 40, Duration::ZERO, 1.0).ends_with("eta ?"));
    }
}
