//! The lexer of the text format: turns source text into tokens that carry their line and
//! column, one token at a time so that the first error in the file is the one reported.

use std::fmt;
use std::iter::Peekable;
use std::str::CharIndices;

use super::ParseError;

/// What a token is.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum TokKind {
    /// `[A-Za-z_][A-Za-z0-9_]*`: keywords, mnemonics, dtypes, placements, enum values.
    Ident(String),
    /// `%N`: a value number.
    Value(u32),
    /// `^N`: a value of a fusion body.
    BodyValue(u32),
    /// A number literal, kept as written: `12`, `0.02`, `1e-5`, `0x7ff8000000000001`. A
    /// leading minus sign is a separate [`TokKind::Minus`].
    Number(String),
    /// A string literal, escapes resolved.
    Str(String),
    /// `{`
    LBrace,
    /// `}`
    RBrace,
    /// `[`
    LBracket,
    /// `]`
    RBracket,
    /// `(`
    LParen,
    /// `)`
    RParen,
    /// `,`
    Comma,
    /// `:`
    Colon,
    /// `=`
    Eq,
    /// `-`
    Minus,
    /// `;` (between the instructions of a fusion body)
    Semicolon,
    /// The end of the source.
    Eof,
}

impl TokKind {
    /// How the token is named in "expected X" messages (`` `=` ``).
    pub(crate) fn punct(&self) -> Option<&'static str> {
        Some(match self {
            TokKind::LBrace => "{",
            TokKind::RBrace => "}",
            TokKind::LBracket => "[",
            TokKind::RBracket => "]",
            TokKind::LParen => "(",
            TokKind::RParen => ")",
            TokKind::Comma => ",",
            TokKind::Colon => ":",
            TokKind::Eq => "=",
            TokKind::Minus => "-",
            TokKind::Semicolon => ";",
            TokKind::Ident(_)
            | TokKind::Value(_)
            | TokKind::BodyValue(_)
            | TokKind::Number(_)
            | TokKind::Str(_)
            | TokKind::Eof => return None,
        })
    }
}

/// Longest literal or word shown in full in an error message.
const MAX_SHOWN: usize = 40;

/// `s`, cut to [`MAX_SHOWN`] characters (with `...`) so that messages stay short whatever
/// the input.
pub(crate) fn shorten(s: &str) -> String {
    let mut out: String = s.chars().take(MAX_SHOWN).collect();
    if s.chars().nth(MAX_SHOWN).is_some() {
        out.push_str("...");
    }
    out
}

impl fmt::Display for TokKind {
    /// The token as "found X" messages show it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokKind::Ident(s) | TokKind::Number(s) => write!(f, "`{}`", shorten(s)),
            TokKind::Value(n) => write!(f, "`%{n}`"),
            TokKind::Str(s) => write!(f, "`{}`", shorten(&super::print::quote(s))),
            TokKind::Eof => f.write_str("end of input"),
            other => write!(f, "`{}`", other.punct().unwrap_or("?")),
        }
    }
}

/// A token and where it starts (1-based line and column, columns counted in characters).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Token {
    pub(crate) kind: TokKind,
    pub(crate) pos: Pos,
}

/// A 1-based source position; columns count characters, a tab being one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pos {
    pub(crate) line: usize,
    pub(crate) col: usize,
}

impl Pos {
    /// An error at this position.
    pub(crate) fn error(self, message: impl Into<String>) -> ParseError {
        ParseError {
            line: self.line,
            col: self.col,
            message: message.into(),
        }
    }
}

/// A one-token-at-a-time lexer over the source.
pub(crate) struct Lexer<'a> {
    chars: Peekable<CharIndices<'a>>,
    pos: Pos,
}

impl<'a> Lexer<'a> {
    pub(crate) fn new(src: &'a str) -> Self {
        Lexer {
            chars: src.char_indices().peekable(),
            pos: Pos { line: 1, col: 1 },
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.chars.peek().map(|&(_, c)| c)
    }

    fn bump(&mut self) -> Option<char> {
        let (_, c) = self.chars.next()?;
        if c == '\n' {
            self.pos.line += 1;
            self.pos.col = 1;
        } else {
            self.pos.col += 1;
        }
        Some(c)
    }

    /// Skips whitespace and `#` comments.
    fn skip_trivia(&mut self) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while self.peek().is_some_and(|c| c != '\n') {
                    self.bump();
                }
            } else if c.is_whitespace() {
                self.bump();
            } else {
                break;
            }
        }
    }

    /// Takes characters while `keep` holds, appending them to `out`.
    fn take_while(&mut self, out: &mut String, keep: impl Fn(char) -> bool) {
        while let Some(c) = self.peek().filter(|&c| keep(c)) {
            out.push(c);
            self.bump();
        }
    }

    /// The next token.
    pub(crate) fn next_token(&mut self) -> Result<Token, ParseError> {
        self.skip_trivia();
        let pos = self.pos;
        let Some(c) = self.bump() else {
            return Ok(Token {
                kind: TokKind::Eof,
                pos,
            });
        };
        let kind = match c {
            '{' => TokKind::LBrace,
            '}' => TokKind::RBrace,
            '[' => TokKind::LBracket,
            ']' => TokKind::RBracket,
            '(' => TokKind::LParen,
            ')' => TokKind::RParen,
            ',' => TokKind::Comma,
            ':' => TokKind::Colon,
            '=' => TokKind::Eq,
            '-' => TokKind::Minus,
            ';' => TokKind::Semicolon,
            '"' => TokKind::Str(self.string(pos)?),
            '%' => TokKind::Value(self.value_number(pos)?),
            '^' => TokKind::BodyValue(self.value_number(pos)?),
            c if c.is_ascii_digit() => TokKind::Number(self.number(c)?),
            c if c.is_ascii_alphabetic() || c == '_' => {
                let mut s = String::from(c);
                self.take_while(&mut s, |c| c.is_ascii_alphanumeric() || c == '_');
                TokKind::Ident(s)
            }
            c => {
                return Err(pos.error(format!("unexpected character `{}`", c.escape_default())));
            }
        };
        Ok(Token { kind, pos })
    }

    /// The digits of `%N` (the `%` is consumed).
    fn value_number(&mut self, start: Pos) -> Result<u32, ParseError> {
        let mut digits = String::new();
        self.take_while(&mut digits, |c| c.is_ascii_digit());
        if digits.is_empty() {
            return Err(start.error("expected a value number after `%`"));
        }
        digits
            .parse::<u32>()
            .map_err(|_| start.error(format!("value number `%{}` is too large", shorten(&digits))))
    }

    /// A number literal whose first digit `first` is consumed. Decimal integers, decimals
    /// with an optional exponent, and `0x` hexadecimal integers.
    fn number(&mut self, first: char) -> Result<String, ParseError> {
        let mut s = String::from(first);
        if first == '0' && self.peek() == Some('x') {
            self.bump();
            s.push('x');
            self.take_while(&mut s, |c| c.is_ascii_hexdigit());
            if s.len() == 2 {
                return Err(self.pos.error("expected hexadecimal digits after `0x`"));
            }
            return Ok(s);
        }
        self.take_while(&mut s, |c| c.is_ascii_digit());
        if self.peek() == Some('.') {
            self.bump();
            s.push('.');
            if !self.peek().is_some_and(|c| c.is_ascii_digit()) {
                return Err(self.pos.error("expected a digit after the decimal point"));
            }
            self.take_while(&mut s, |c| c.is_ascii_digit());
        }
        if let Some(e @ ('e' | 'E')) = self.peek() {
            // Only an exponent if digits follow; otherwise `e` starts the next token.
            let mut ahead = self.chars.clone();
            ahead.next();
            let next = ahead.next().map(|(_, c)| c);
            let after_sign = ahead.next().map(|(_, c)| c);
            let is_exponent = match next {
                Some(c) if c.is_ascii_digit() => true,
                Some('+' | '-') => after_sign.is_some_and(|c| c.is_ascii_digit()),
                _ => false,
            };
            if is_exponent {
                self.bump();
                s.push(e);
                if let Some(sign @ ('+' | '-')) = self.peek() {
                    self.bump();
                    s.push(sign);
                }
                self.take_while(&mut s, |c| c.is_ascii_digit());
            }
        }
        Ok(s)
    }

    /// The rest of a string literal whose opening quote (at `start`) is consumed.
    fn string(&mut self, start: Pos) -> Result<String, ParseError> {
        let mut s = String::new();
        loop {
            let here = self.pos;
            match self.bump() {
                None | Some('\n') => {
                    return Err(start.error("unterminated string (strings end on their line)"));
                }
                Some('"') => return Ok(s),
                Some('\\') => s.push(self.escape(here)?),
                Some(c) => s.push(c),
            }
        }
    }

    /// An escape sequence whose backslash (at `start`) is consumed.
    fn escape(&mut self, start: Pos) -> Result<char, ParseError> {
        match self.bump() {
            Some('"') => Ok('"'),
            Some('\\') => Ok('\\'),
            Some('n') => Ok('\n'),
            Some('t') => Ok('\t'),
            Some('u') => {
                if self.bump() != Some('{') {
                    return Err(start.error("expected `{` after `\\u`"));
                }
                let mut hex = String::new();
                self.take_while(&mut hex, |c| c.is_ascii_hexdigit());
                if self.bump() != Some('}') || hex.is_empty() || hex.len() > 6 {
                    return Err(start.error("expected 1 to 6 hexadecimal digits in `\\u{...}`"));
                }
                u32::from_str_radix(&hex, 16)
                    .ok()
                    .and_then(char::from_u32)
                    .ok_or_else(|| {
                        start.error(format!("`\\u{{{hex}}}` is not a Unicode scalar value"))
                    })
            }
            Some(c) => Err(start.error(format!(
                "unknown escape `\\{}` (expected \\\", \\\\, \\n, \\t or \\u{{...}})",
                c.escape_default()
            ))),
            None => Err(start.error("unterminated string (strings end on their line)")),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn kinds(src: &str) -> Result<Vec<TokKind>, ParseError> {
        let mut lx = Lexer::new(src);
        let mut out = Vec::new();
        loop {
            let t = lx.next_token()?;
            if t.kind == TokKind::Eof {
                return Ok(out);
            }
            out.push(t.kind);
        }
    }

    #[test]
    fn numbers_and_exponents() {
        let toks = kinds("1e-5 0.02 12 1.5E+3 2e x 0x7fF8").unwrap();
        let expect = ["1e-5", "0.02", "12", "1.5E+3", "2"];
        for (t, e) in toks.iter().zip(expect) {
            assert_eq!(*t, TokKind::Number(e.into()));
        }
        assert_eq!(toks[5], TokKind::Ident("e".into()));
        assert_eq!(toks[6], TokKind::Ident("x".into()));
        assert_eq!(toks[7], TokKind::Number("0x7fF8".into()));
    }

    #[test]
    fn strings_and_escapes() {
        let toks = kinds(
            r#""a\"b\\c\n\t\u{1}é" %12 # comment "x"
            -inf"#,
        )
        .unwrap();
        assert_eq!(
            toks,
            vec![
                TokKind::Str("a\"b\\c\n\t\u{1}é".into()),
                TokKind::Value(12),
                TokKind::Minus,
                TokKind::Ident("inf".into()),
            ]
        );
    }

    #[test]
    fn positions_count_characters() {
        let mut lx = Lexer::new(r#""é\u{1}" %3"#);
        lx.next_token().unwrap();
        let t = lx.next_token().unwrap();
        assert_eq!((t.pos.line, t.pos.col), (1, 10));
        assert_eq!(lx.next_token().unwrap().kind, TokKind::Eof);
        let mut lx = Lexer::new("ab cd\n  %3");
        lx.next_token().unwrap();
        let t = lx.next_token().unwrap();
        assert_eq!((t.pos.line, t.pos.col), (1, 4));
        let t = lx.next_token().unwrap();
        assert_eq!((t.pos.line, t.pos.col), (2, 3));
    }

    #[test]
    fn lexical_errors() {
        let err = |src: &str| kinds(src).unwrap_err();
        let e = err("%99999999999");
        assert_eq!((e.line, e.col), (1, 1));
        assert!(e.message.contains("too large"), "{e}");
        assert!(err("\"abc\n\"").message.contains("unterminated"));
        assert!(err(r#""\q""#).message.contains("unknown escape"));
        assert!(
            err(r#""\u{d800}""#)
                .message
                .contains("not a Unicode scalar")
        );
        assert!(err(r#""\u{1234567}""#).message.contains("1 to 6"));
        let e = err("  1.x");
        assert_eq!((e.line, e.col), (1, 5));
        let e = err("a\n ~");
        assert_eq!((e.line, e.col), (2, 2));
        assert_eq!(e.message, "unexpected character `~`");
    }
}
