//! Counter-based random numbers: every draw is a pure function of a key and an index, so any
//! element of any stream can be produced alone, in any order, on any rank.

/// Increment of the splitmix64 sequence (the golden ratio in 64-bit fixed point).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser applied to `z + GOLDEN`: a bijective 64-bit mix.
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A keyed stream of random numbers indexed by a counter. Streams are named by a seed and a
/// label (such as a parameter name) and can be narrowed further with [`Stream::derive`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream {
    key: u64,
}

impl Stream {
    /// The stream named `label` under `seed`.
    pub fn new(seed: u64, label: &str) -> Stream {
        let mut key = splitmix64(seed);
        for chunk in label.as_bytes().chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            key = splitmix64(key ^ u64::from_le_bytes(word));
        }
        // The length separates labels that differ only by trailing zero bytes.
        Stream {
            key: splitmix64(key ^ label.len() as u64),
        }
    }

    /// A sub-stream, e.g. one per training step.
    pub fn derive(self, n: u64) -> Stream {
        Stream {
            key: splitmix64(self.key ^ splitmix64(n)),
        }
    }

    /// 64 random bits at position `i` (element `i` of the splitmix64 sequence seeded by the key).
    pub fn bits(self, i: u64) -> u64 {
        splitmix64(self.key.wrapping_add(i.wrapping_mul(GOLDEN)))
    }

    /// Uniform in `(0, 1]` at position `i` (never 0, so its logarithm is finite).
    pub fn uniform_open(self, i: u64) -> f64 {
        ((self.bits(i) >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..n` at position `i` (`n > 0`), by multiply-shift.
    pub fn below(self, i: u64, n: u64) -> u64 {
        ((u128::from(self.bits(i)) * u128::from(n)) >> 64) as u64
    }

    /// Standard normal at position `i`, by Box–Muller on positions `2i` and `2i + 1`.
    pub fn normal(self, i: u64) -> f64 {
        let u1 = self.uniform_open(i.wrapping_mul(2));
        let u2 = self.uniform_open(i.wrapping_mul(2).wrapping_add(1));
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_pure_functions_of_key_and_index() {
        let s = Stream::new(7, "h.0.mlp.w1");
        assert_eq!(s.bits(12), Stream::new(7, "h.0.mlp.w1").bits(12));
        assert_ne!(s.bits(12), Stream::new(8, "h.0.mlp.w1").bits(12));
        assert_ne!(s.bits(12), Stream::new(7, "h.0.mlp.w2").bits(12));
        assert_ne!(Stream::new(7, "a").bits(0), Stream::new(7, "a\0").bits(0));
        assert_ne!(s.derive(1).bits(0), s.derive(2).bits(0));
    }

    #[test]
    fn normal_draws_have_unit_moments() {
        let s = Stream::new(1, "moments");
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|i| s.normal(i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "variance {var}");
        assert!(xs.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn below_stays_in_range() {
        let s = Stream::new(3, "below");
        assert!((0..1000).all(|i| s.below(i, 7) < 7));
        assert!((0..7).all(|v| (0..1000).any(|i| s.below(i, 7) == v)));
    }
}
