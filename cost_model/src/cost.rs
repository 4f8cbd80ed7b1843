//! [`Cost`]: a duration in nanoseconds with saturating arithmetic and an explicit
//! infeasible value, the currency in which every time estimate is reported.

use std::fmt;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Mul};

use serde::{Deserialize, Serialize};

/// A duration in whole nanoseconds. Arithmetic saturates at [`Cost::INFEASIBLE`], which stays
/// infeasible under addition and compares greater than every feasible cost, so a search can
/// add costs without checking and rank infeasible plans last.
///
/// ```
/// # use autopar_cost_model::Cost;
/// let a = Cost::from_secs(1.5e-3);
/// assert_eq!(a.nanos(), 1_500_000);
/// assert_eq!(a + Cost::INFEASIBLE, Cost::INFEASIBLE);
/// assert!(a < Cost::INFEASIBLE);
/// assert_eq!(Cost::from_secs(f64::NAN), Cost::INFEASIBLE);
/// ```
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Cost(u64);

impl Cost {
    /// No time.
    pub const ZERO: Cost = Cost(0);
    /// The cost of something that cannot be done (does not fit, unsupported).
    pub const INFEASIBLE: Cost = Cost(u64::MAX);

    /// From nanoseconds; `u64::MAX` is infeasible.
    pub const fn from_nanos(ns: u64) -> Cost {
        Cost(ns)
    }

    /// From seconds, rounded to the nearest nanosecond. Negative values are zero; NaN,
    /// infinities and values beyond the range are infeasible.
    pub fn from_secs(s: f64) -> Cost {
        if s.is_nan() {
            return Cost::INFEASIBLE;
        }
        let ns = (s * 1e9).round();
        if ns <= 0.0 {
            Cost::ZERO
        } else if ns >= u64::MAX as f64 {
            Cost::INFEASIBLE
        } else {
            Cost(ns as u64)
        }
    }

    /// Nanoseconds (`u64::MAX` when infeasible).
    pub const fn nanos(self) -> u64 {
        self.0
    }

    /// Seconds; infinity when infeasible.
    pub fn secs(self) -> f64 {
        if self.is_feasible() {
            self.0 as f64 * 1e-9
        } else {
            f64::INFINITY
        }
    }

    /// False for [`Cost::INFEASIBLE`].
    pub const fn is_feasible(self) -> bool {
        self.0 != u64::MAX
    }

    /// `self - other`, zero when `other` is larger; infeasible stays infeasible.
    pub fn saturating_sub(self, other: Cost) -> Cost {
        if !self.is_feasible() {
            return self;
        }
        Cost(self.0.saturating_sub(other.0))
    }
}

impl Add for Cost {
    type Output = Cost;
    fn add(self, rhs: Cost) -> Cost {
        Cost(self.0.saturating_add(rhs.0))
    }
}

impl AddAssign for Cost {
    fn add_assign(&mut self, rhs: Cost) {
        *self = *self + rhs;
    }
}

impl Mul<u64> for Cost {
    type Output = Cost;
    fn mul(self, rhs: u64) -> Cost {
        if rhs == 0 {
            Cost::ZERO
        } else {
            Cost(self.0.saturating_mul(rhs))
        }
    }
}

impl Sum for Cost {
    fn sum<I: Iterator<Item = Cost>>(iter: I) -> Cost {
        iter.fold(Cost::ZERO, Add::add)
    }
}

impl fmt::Display for Cost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.is_feasible() {
            return f.write_str("infeasible");
        }
        let s = self.secs();
        if s >= 1.0 {
            write!(f, "{s:.3} s")
        } else if s >= 1e-3 {
            write!(f, "{:.3} ms", s * 1e3)
        } else {
            write!(f, "{:.3} us", s * 1e6)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let big = Cost::from_nanos(u64::MAX - 1);
        assert_eq!(big + Cost::from_nanos(5), Cost::INFEASIBLE);
        assert_eq!(Cost::from_nanos(3) * std::hint::black_box(0), Cost::ZERO);
        assert_eq!(Cost::INFEASIBLE * 2, Cost::INFEASIBLE);
        assert_eq!(
            Cost::from_nanos(3).saturating_sub(Cost::from_nanos(5)),
            Cost::ZERO
        );
        assert_eq!(
            Cost::INFEASIBLE.saturating_sub(Cost::from_nanos(5)),
            Cost::INFEASIBLE
        );
        assert_eq!(Cost::from_secs(-1.0), Cost::ZERO);
        assert_eq!(Cost::from_secs(f64::INFINITY), Cost::INFEASIBLE);
        assert_eq!(Cost::INFEASIBLE.secs(), f64::INFINITY);
        let total: Cost = [Cost::from_nanos(1), Cost::from_nanos(2)].into_iter().sum();
        assert_eq!(total.nanos(), 3);
        assert_eq!(Cost::from_secs(2.5e-3).to_string(), "2.500 ms");
        assert_eq!(Cost::INFEASIBLE.to_string(), "infeasible");
    }
}
