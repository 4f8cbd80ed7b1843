//! JSON dump.
