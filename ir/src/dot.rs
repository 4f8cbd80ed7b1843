//! Graphviz DOT dump.
