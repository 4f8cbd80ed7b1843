//! A small SVG writer: elements with escaped attributes and text, and numbers written with
//! at most two decimals, so that the pictures of `autopar report` are generated, compact and
//! safe to inline in HTML.

use std::fmt::Write as _;

/// Escapes text for an HTML/SVG attribute value or text node.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A coordinate or length: at most two decimals, no trailing zeros, 0 for non-finite values
/// (`12.50` → `12.5`, `3.0` → `3`).
pub fn num(x: f64) -> String {
    if !x.is_finite() {
        return "0".into();
    }
    let r = (x * 100.0).round() / 100.0;
    let mut s = format!("{r:.2}");
    while s.ends_with('0') {
        s.pop();
    }
    if s.ends_with('.') {
        s.pop();
    }
    if s == "-0" { "0".into() } else { s }
}

/// The attributes of one element, in order.
#[derive(Default)]
pub struct Attrs(String);

impl Attrs {
    /// No attributes.
    pub fn new() -> Self {
        Attrs(String::new())
    }

    /// A numeric attribute.
    pub fn n(mut self, name: &str, value: f64) -> Self {
        let _ = write!(self.0, " {name}=\"{}\"", num(value));
        self
    }

    /// A text attribute (escaped).
    pub fn s(mut self, name: &str, value: impl AsRef<str>) -> Self {
        let _ = write!(self.0, " {name}=\"{}\"", esc(value.as_ref()));
        self
    }
}

/// An SVG picture being written.
pub struct Svg {
    body: String,
    width: f64,
    height: f64,
    root: Attrs,
}

impl Svg {
    /// An empty picture of the given size, with extra attributes on the `<svg>` element
    /// (class, `data-*` counts, an accessible label).
    pub fn new(width: f64, height: f64, root: Attrs) -> Self {
        Svg {
            body: String::new(),
            width,
            height,
            root,
        }
    }

    /// Replaces the extra attributes of the `<svg>` element (for counts known only once the
    /// picture is drawn).
    pub fn set_root(&mut self, root: Attrs) {
        self.root = root;
    }

    /// Grows the picture to at least this height.
    pub fn fit_height(&mut self, height: f64) {
        self.height = self.height.max(height);
    }

    /// `<name attrs/>`.
    pub fn leaf(&mut self, name: &str, attrs: Attrs) {
        let _ = write!(self.body, "<{name}{}/>", attrs.0);
    }

    /// `<name attrs><title>title</title></name>`: an element with a tooltip.
    pub fn leaf_titled(&mut self, name: &str, attrs: Attrs, title: &str) {
        let _ = write!(
            self.body,
            "<{name}{}><title>{}</title></{name}>",
            attrs.0,
            esc(title)
        );
    }

    /// `<name attrs>` (close it with [`Svg::close`]).
    pub fn open(&mut self, name: &str, attrs: Attrs) {
        let _ = write!(self.body, "<{name}{}>", attrs.0);
    }

    /// `</name>`.
    pub fn close(&mut self, name: &str) {
        let _ = write!(self.body, "</{name}>");
    }

    /// `<text attrs>content</text>`.
    pub fn text(&mut self, attrs: Attrs, content: &str) {
        let _ = write!(self.body, "<text{}>{}</text>", attrs.0, esc(content));
    }

    /// A `<text>` of coloured runs: `(content, fill)` pairs, `None` for the default fill.
    pub fn text_runs(&mut self, attrs: Attrs, runs: &[(String, Option<&str>)]) {
        let _ = write!(self.body, "<text{}>", attrs.0);
        for (content, fill) in runs {
            match fill {
                Some(f) => {
                    let _ = write!(
                        self.body,
                        "<tspan fill=\"{}\">{}</tspan>",
                        esc(f),
                        esc(content)
                    );
                }
                None => {
                    let _ = write!(self.body, "<tspan>{}</tspan>", esc(content));
                }
            }
        }
        self.body.push_str("</text>");
    }

    /// A rectangle.
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, extra: Attrs) {
        let a = Attrs::new()
            .n("x", x)
            .n("y", y)
            .n("width", w.max(0.0))
            .n("height", h.max(0.0));
        let _ = write!(self.body, "<rect{}{}/>", a.0, extra.0);
    }

    /// A straight line.
    pub fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), extra: Attrs) {
        let a = Attrs::new().n("x1", x1).n("y1", y1).n("x2", x2).n("y2", y2);
        let _ = write!(self.body, "<line{}{}/>", a.0, extra.0);
    }

    /// The finished `<svg>` element.
    pub fn finish(self) -> String {
        format!(
            "<svg viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\"{}>{}</svg>",
            self.root.0,
            self.body,
            w = num(self.width),
            h = num(self.height)
        )
    }
}

/// A path's `d` attribute through points (`M x y L x y ...`).
pub fn polyline_d(points: &[(f64, f64)]) -> String {
    let mut d = String::new();
    for (i, (x, y)) in points.iter().enumerate() {
        let _ = write!(
            d,
            "{}{} {}",
            if i == 0 { "M" } else { " L" },
            num(*x),
            num(*y)
        );
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_escapes() {
        assert_eq!(num(12.504), "12.5");
        assert_eq!(num(3.0), "3");
        assert_eq!(num(-0.001), "0");
        assert_eq!(num(f64::NAN), "0");
        assert_eq!(esc("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
        let mut s = Svg::new(10.0, 5.0, Attrs::new().s("class", "x"));
        s.rect(1.0, 2.0, 3.333, 4.0, Attrs::new().s("class", "gpu"));
        s.text(Attrs::new().n("x", 0.0), "<&>");
        let out = s.finish();
        assert!(out.contains("<rect x=\"1\" y=\"2\" width=\"3.33\" height=\"4\" class=\"gpu\"/>"));
        assert!(out.contains("&lt;&amp;&gt;"));
        assert_eq!(polyline_d(&[(0.0, 1.0), (2.5, 3.0)]), "M0 1 L2.5 3");
    }
}
