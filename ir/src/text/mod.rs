//! Text format (printer and parser) for `.air` files.
