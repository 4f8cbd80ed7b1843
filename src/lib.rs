//! autopar
