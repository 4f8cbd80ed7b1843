//! The buffer pool of one loaded program: storage freed after a value's last use (or dropped
//! by whoever held an output) comes back here, keyed by element kind and length, and the next
//! value of that size takes it instead of a fresh allocation, so that a steady-state step
//! neither allocates nor page-faults. The pool keeps at most `limit` bytes; it also counts the
//! bytes of its storage alive at once (the backend's real tensor memory).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::storage::Elems;

/// Free buffers by length, per element kind.
#[derive(Debug, Default)]
struct Free {
    f32s: HashMap<usize, Vec<Vec<f32>>>,
    ints: HashMap<usize, Vec<Vec<i64>>>,
    bools: HashMap<usize, Vec<Vec<bool>>>,
    f64s: HashMap<usize, Vec<Vec<f64>>>,
    bytes: u64,
}

/// Reused storage of one executable (see the module docs).
#[derive(Debug)]
pub struct Pool {
    free: Mutex<Free>,
    limit: u64,
}

impl Pool {
    /// A pool that keeps at most `limit` bytes of free storage.
    pub fn new(limit: u64) -> Arc<Pool> {
        Arc::new(Pool {
            free: Mutex::new(Free::default()),
            limit,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Free> {
        // A panic while holding the lock leaves only free lists behind: still usable.
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A buffer of `len` floats whose contents are unspecified (stale values of an earlier
    /// tensor, or zeros): the caller writes every element.
    pub fn f32s(&self, len: usize) -> Vec<f32> {
        let reused = {
            let mut free = self.lock();
            let v = free.f32s.get_mut(&len).and_then(Vec::pop);
            if v.is_some() {
                free.bytes -= len as u64 * 4;
            }
            v
        };
        reused.unwrap_or_else(|| vec![0.0; len])
    }

    /// A buffer of `len` integers with unspecified contents.
    pub fn ints(&self, len: usize) -> Vec<i64> {
        let reused = {
            let mut free = self.lock();
            let v = free.ints.get_mut(&len).and_then(Vec::pop);
            if v.is_some() {
                free.bytes -= len as u64 * 8;
            }
            v
        };
        reused.unwrap_or_else(|| vec![0; len])
    }

    /// A buffer of `len` booleans with unspecified contents.
    pub fn bools(&self, len: usize) -> Vec<bool> {
        let reused = {
            let mut free = self.lock();
            let v = free.bools.get_mut(&len).and_then(Vec::pop);
            if v.is_some() {
                free.bytes -= len as u64;
            }
            v
        };
        reused.unwrap_or_else(|| vec![false; len])
    }

    /// A scratch buffer of `len` doubles with unspecified contents (for wide accumulation),
    /// to be handed back with [`Pool::give_back_f64s`].
    pub fn f64s(&self, len: usize) -> Vec<f64> {
        let reused = {
            let mut free = self.lock();
            let v = free.f64s.get_mut(&len).and_then(Vec::pop);
            if v.is_some() {
                free.bytes -= len as u64 * 8;
            }
            v
        };
        reused.unwrap_or_else(|| vec![0.0; len])
    }

    /// Takes a scratch buffer of doubles back.
    pub fn give_back_f64s(&self, v: Vec<f64>) {
        let bytes = v.len() as u64 * 8;
        let mut free = self.lock();
        if bytes == 0 || free.bytes + bytes > self.limit {
            return;
        }
        free.bytes += bytes;
        free.f64s.entry(v.len()).or_default().push(v);
    }

    /// Takes storage back for reuse (dropping it when the pool is full).
    pub(crate) fn give_back(&self, elems: Elems) {
        let bytes = elems.bytes();
        if bytes == 0 {
            return;
        }
        let mut free = self.lock();
        if free.bytes + bytes > self.limit {
            return;
        }
        free.bytes += bytes;
        match elems {
            Elems::F32(v) => free.f32s.entry(v.len()).or_default().push(v),
            Elems::Int(v) => free.ints.entry(v.len()).or_default().push(v),
            Elems::Bool(v) => free.bools.entry(v.len()).or_default().push(v),
        }
    }

    /// Bytes of free storage held.
    pub fn free_bytes(&self) -> u64 {
        self.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_are_reused_up_to_the_limit() {
        let pool = Pool::new(64);
        let v = pool.f32s(8);
        let ptr = v.as_ptr();
        pool.give_back(Elems::F32(v));
        assert_eq!(pool.free_bytes(), 32);
        let again = pool.f32s(8);
        assert_eq!(again.as_ptr(), ptr);
        assert_eq!(pool.free_bytes(), 0);
        // Over the limit: dropped, not kept.
        pool.give_back(Elems::F32(vec![0.0; 100]));
        assert_eq!(pool.free_bytes(), 0);
        pool.give_back(Elems::Int(vec![0; 4]));
        assert_eq!(pool.ints(4).len(), 4);
        assert_eq!(pool.bools(3).len(), 3);
    }
}
