//! Region algebra of checkpoint shards: the overlap of two regions of a tensor, and the copy
//! of that overlap from one region's elements to another's. Resharding is nothing more: every
//! region a rank needs is assembled from the saved regions it overlaps.

use std::ops::Range;

use autopar_runtime::Data;

/// A box of a tensor: per dim, a range of global indices.
pub(crate) type Region = Vec<Range<usize>>;

/// The elements of `region`.
pub(crate) fn volume(region: &[Range<usize>]) -> usize {
    region.iter().map(|r| r.len()).product()
}

/// The common part of `a` and `b` (same rank), or `None` when they do not meet.
pub(crate) fn overlap(a: &[Range<usize>], b: &[Range<usize>]) -> Option<Region> {
    if a.len() != b.len() {
        return None;
    }
    let common: Region = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.start.max(y.start)..x.end.min(y.end))
        .collect();
    common.iter().all(|r| r.start < r.end).then_some(common)
}

/// Copies the elements of `part` (inside both regions) from `src`, the row-major elements
/// of `src_region`, into `dst`, those of `dst_region`. Both buffers must be of the same
/// kind and hold exactly their regions' elements (checked by the caller).
pub(crate) fn copy(
    src: &Data,
    src_region: &[Range<usize>],
    dst: &mut Data,
    dst_region: &[Range<usize>],
    part: &[Range<usize>],
) {
    match (src, dst) {
        (Data::Float(s), Data::Float(d)) => copy_slice(s, src_region, d, dst_region, part),
        (Data::Int(s), Data::Int(d)) => copy_slice(s, src_region, d, dst_region, part),
        (Data::Bool(s), Data::Bool(d)) => copy_slice(s, src_region, d, dst_region, part),
        // Different kinds cannot meet: both come from the same tensor's dtype.
        _ => {}
    }
}

fn copy_slice<T: Copy>(
    src: &[T],
    src_region: &[Range<usize>],
    dst: &mut [T],
    dst_region: &[Range<usize>],
    part: &[Range<usize>],
) {
    let strides = |region: &[Range<usize>]| {
        let mut s = vec![1usize; region.len()];
        for d in (0..region.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * region[d + 1].len();
        }
        s
    };
    let (ss, ds) = (strides(src_region), strides(dst_region));
    let rank = part.len();
    if rank == 0 {
        if let (Some(&x), Some(slot)) = (src.first(), dst.first_mut()) {
            *slot = x;
        }
        return;
    }
    let last = rank - 1;
    let run = part[last].len();
    // An odometer over every dim but the last; each position copies one contiguous run.
    let mut index: Vec<usize> = part.iter().map(|r| r.start).collect();
    loop {
        let offset = |region: &[Range<usize>], strides: &[usize]| -> usize {
            index
                .iter()
                .zip(region)
                .zip(strides)
                .map(|((&i, r), &s)| (i - r.start) * s)
                .sum()
        };
        let (so, d_o) = (offset(src_region, &ss), offset(dst_region, &ds));
        if let (Some(from), Some(to)) = (src.get(so..so + run), dst.get_mut(d_o..d_o + run)) {
            to.copy_from_slice(from);
        }
        // Advance the odometer over dims 0..last.
        let mut d = last;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < part[d].end {
                break;
            }
            index[d] = part[d].start;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overlap_is_copied_between_two_regions() {
        // A 4 x 6 tensor whose element (i, j) is 10 i + j.
        let value = |i: usize, j: usize| (10 * i + j) as f64;
        let region = |r: Range<usize>, c: Range<usize>| vec![r, c];
        let fill = |reg: &Region| {
            let mut v = Vec::new();
            for i in reg[0].clone() {
                for j in reg[1].clone() {
                    v.push(value(i, j));
                }
            }
            Data::Float(v)
        };
        let src_region = region(0..2, 0..6);
        let dst_region = region(1..4, 2..5);
        let part = overlap(&src_region, &dst_region).expect("they meet");
        assert_eq!(part, region(1..2, 2..5));
        let mut dst = Data::Float(vec![f64::NAN; volume(&dst_region)]);
        copy(
            &fill(&src_region),
            &src_region,
            &mut dst,
            &dst_region,
            &part,
        );
        let Data::Float(d) = dst else { unreachable!() };
        assert_eq!(&d[..3], &[12.0, 13.0, 14.0]);
        assert!(d[3..].iter().all(|x| x.is_nan()));
        assert_eq!(overlap(&region(0..2, 0..2), &region(2..4, 0..2)), None);
    }

    #[test]
    fn a_scalar_is_its_own_overlap() {
        let mut dst = Data::Int(vec![0]);
        copy(&Data::Int(vec![7]), &[], &mut dst, &[], &[]);
        assert!(matches!(dst, Data::Int(v) if v == [7]));
        assert_eq!(overlap(&[], &[]), Some(vec![]));
    }
}
