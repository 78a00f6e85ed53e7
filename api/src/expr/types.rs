//! What an expression can return, where its tree makes that known: a comparison is a bool,
//! `topic + '/x'` a string, `size(x)` an int; a field of `json` could be anything. The answer
//! is a set of CEL types that holds every value the evaluation can return (never fewer), so a
//! field that needs a bool refuses only an expression that can never give one.

use cel::common::ast::{Expr, IdedExpr, LiteralValue};

/// A set of CEL types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kinds(u16);

impl Kinds {
    pub const BOOL: Kinds = Kinds(1);
    pub const INT: Kinds = Kinds(1 << 1);
    pub const UINT: Kinds = Kinds(1 << 2);
    pub const DOUBLE: Kinds = Kinds(1 << 3);
    pub const STRING: Kinds = Kinds(1 << 4);
    pub const BYTES: Kinds = Kinds(1 << 5);
    pub const LIST: Kinds = Kinds(1 << 6);
    pub const MAP: Kinds = Kinds(1 << 7);
    pub const NULL: Kinds = Kinds(1 << 8);
    pub const TIMESTAMP: Kinds = Kinds(1 << 9);
    pub const DURATION: Kinds = Kinds(1 << 10);
    pub const TYPE: Kinds = Kinds(1 << 11);
    /// Unknown: any type.
    pub const ANY: Kinds = Kinds((1 << 12) - 1);

    const NAMES: [(Kinds, &'static str); 12] = [
        (Self::BOOL, "a bool"),
        (Self::INT, "an int"),
        (Self::UINT, "a uint"),
        (Self::DOUBLE, "a double"),
        (Self::STRING, "a string"),
        (Self::BYTES, "bytes"),
        (Self::LIST, "a list"),
        (Self::MAP, "a map"),
        (Self::NULL, "null"),
        (Self::TIMESTAMP, "a timestamp"),
        (Self::DURATION, "a duration"),
        (Self::TYPE, "a type"),
    ];

    pub const fn or(self, other: Kinds) -> Kinds {
        Kinds(self.0 | other.0)
    }

    pub fn intersects(self, other: Kinds) -> bool {
        self.0 & other.0 != 0
    }

    fn and(self, other: Kinds) -> Kinds {
        Kinds(self.0 & other.0)
    }
}

impl std::fmt::Display for Kinds {
    /// `a string`, `an int or a double`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(k, _)| self.intersects(*k))
            .map(|(_, n)| *n)
            .collect();
        f.write_str(&names.join(" or "))
    }
}

/// What `+` can make: numbers, text, bytes, lists, maps, times.
const SUMS: Kinds = Kinds(Kinds::ANY.0 & !(Kinds::BOOL.0 | Kinds::NULL.0 | Kinds::TYPE.0));
const NUMBERS: Kinds = Kinds::INT.or(Kinds::UINT).or(Kinds::DOUBLE);
const TIMES: Kinds = Kinds::TIMESTAMP.or(Kinds::DURATION);
/// What `-`, `*`, `/` and `%` can make.
const ARITHMETIC: Kinds = Kinds::INT
    .or(Kinds::UINT)
    .or(Kinds::DOUBLE)
    .or(Kinds::TIMESTAMP)
    .or(Kinds::DURATION);

/// The types `e` can return. `variable` gives a declared variable's type.
pub(super) fn result(e: &IdedExpr, variable: &dyn Fn(&str) -> Option<Kinds>) -> Kinds {
    Walk {
        variable,
        bound: Vec::new(),
    }
    .kinds(e)
}

struct Walk<'a> {
    variable: &'a dyn Fn(&str) -> Option<Kinds>,
    /// A comprehension's own variables, innermost last.
    bound: Vec<(&'a str, Kinds)>,
}

impl<'a> Walk<'a> {
    fn kinds(&mut self, e: &'a IdedExpr) -> Kinds {
        match &e.expr {
            Expr::Literal(l) => match l {
                LiteralValue::Boolean(_) => Kinds::BOOL,
                LiteralValue::Bytes(_) => Kinds::BYTES,
                LiteralValue::Double(_) => Kinds::DOUBLE,
                LiteralValue::Int(_) => Kinds::INT,
                LiteralValue::Null => Kinds::NULL,
                LiteralValue::String(_) => Kinds::STRING,
                LiteralValue::UInt(_) => Kinds::UINT,
            },
            Expr::Ident(name) => match self.bound.iter().rev().find(|(n, _)| n == name) {
                Some((_, kinds)) => *kinds,
                None if super::TYPE_NAMES.contains(&name.as_str()) => Kinds::TYPE,
                None => (self.variable)(name).unwrap_or(Kinds::ANY),
            },
            // `has(x.f)` is a test; a field of a map or of `json` could be anything.
            Expr::Select(s) if s.test => Kinds::BOOL,
            Expr::Select(_) => Kinds::ANY,
            Expr::List(_) => Kinds::LIST,
            Expr::Map(_) => Kinds::MAP,
            Expr::Call(call) => {
                let args: Vec<Kinds> = call.args.iter().map(|a| self.kinds(a)).collect();
                call_kinds(&call.func_name, call.target.is_some(), &args)
            }
            Expr::Comprehension(c) => {
                let mark = self.bound.len();
                self.bound.push((c.iter_var.as_str(), Kinds::ANY));
                if let Some(second) = &c.iter_var2 {
                    self.bound.push((second.as_str(), Kinds::ANY));
                }
                // The accumulator holds its initial value or any step's: grow it until the
                // step adds nothing (a handful of rounds: there are 12 types).
                let mut accu = self.kinds(&c.accu_init);
                for _ in 0..Self::NAMES_LEN {
                    self.bound.push((c.accu_var.as_str(), accu));
                    let step = self.kinds(&c.loop_step);
                    self.bound.pop();
                    if accu.or(step) == accu {
                        break;
                    }
                    accu = accu.or(step);
                }
                self.bound.push((c.accu_var.as_str(), accu));
                let result = self.kinds(&c.result);
                self.bound.truncate(mark);
                result
            }
            Expr::Struct(_) | Expr::Unspecified => Kinds::ANY,
        }
    }

    const NAMES_LEN: usize = Kinds::NAMES.len() + 1;
}

/// A call of `name` (a method when `method`) on arguments of `args`.
fn call_kinds(name: &str, method: bool, args: &[Kinds]) -> Kinds {
    match name {
        "_&&_"
        | "_||_"
        | "!_"
        | "_==_"
        | "_!=_"
        | "_<_"
        | "_<=_"
        | "_>_"
        | "_>=_"
        | "@in"
        | "@not_strictly_false"
        | "contains"
        | "startsWith"
        | "endsWith"
        | "matches"
        | "has" => Kinds::BOOL,
        "_?_:_" => match args {
            [_, a, b] => a.or(*b),
            _ => Kinds::ANY,
        },
        "_+_" => {
            let exactly = |k: Kinds| args.contains(&k);
            if exactly(Kinds::STRING) {
                Kinds::STRING
            } else if exactly(Kinds::BYTES) {
                Kinds::BYTES
            } else if exactly(Kinds::LIST) {
                Kinds::LIST
            } else {
                // No operator adds across these families, but numbers mix, and so do times.
                let both = args.iter().fold(Kinds(0), |acc, k| acc.or(*k));
                let mut sum = both.and(SUMS);
                for family in [NUMBERS, TIMES] {
                    if both.intersects(family) {
                        sum = sum.or(family);
                    }
                }
                sum
            }
        }
        "_-_" | "_*_" | "_/_" | "_%_" | "-_" => ARITHMETIC,
        "size" | "int" | "getFullYear" | "getMonth" | "getDate" | "getDayOfMonth"
        | "getDayOfWeek" | "getDayOfYear" | "getHours" | "getMinutes" | "getSeconds"
        | "getMilliseconds" => Kinds::INT,
        "uint" => Kinds::UINT,
        "double" => Kinds::DOUBLE,
        "string" => Kinds::STRING,
        "bytes" => Kinds::BYTES,
        "bool" => Kinds::BOOL,
        "type" => Kinds::TYPE,
        "timestamp" => Kinds::TIMESTAMP,
        "duration" => Kinds::DURATION,
        "dyn" if !method => args.first().copied().unwrap_or(Kinds::ANY),
        _ => Kinds::ANY,
    }
    .and(Kinds::ANY)
}
