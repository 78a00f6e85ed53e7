//! CEL expressions in rules (`filter`, `kafka.key.expression`, `kafka.topic_expression`,
//! `kafka.headers.expressions`, `payload.transform`): compiled once, when a config is validated,
//! and checked then against the variables a message provides, so that a typo is refused by
//! `--check` and by the operator instead of failing on every message.
//!
//! The checks go beyond parsing, because the crate has no type checker:
//! - every identifier is a declared variable ([`VARIABLES`]) or a comprehension's own;
//! - every function called by name exists in the standard environment;
//! - inside a comprehension (`all`, `exists`, `exists_one`, `map`, `filter`) only its own
//!   variables and the scalar variables may appear, so each element's step costs at most in
//!   proportion to that element (`json.items.map(x, json.items)` would cost the square);
//! - a comprehension ranges over a variable, a field or element of one, or a literal list,
//!   never over what the expression built (a chain of `map(t, t + t)` doubles at every step);
//! - `matches` takes a literal pattern, never one from the message.
//!
//! Then its worst-case cost is estimated (`cost.rs`: every variable at its largest, nesting
//! multiplies) and bounded: over [`COST_BUDGET`] steps or [`RESULT_BUDGET_BYTES`] of result, it
//! is refused with the estimate and the budget. The forwarder runs each evaluation within the
//! same budget (a patch of the `cel` crate counts the steps), which stops what the estimate
//! missed as that message's failure.
//!
//! The walk also records which of `json`'s fields an expression reads ([`JsonReads`]), so that
//! a message's payload is turned into values only where some expression looks.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, LazyLock};

use cel::common::ast::{EntryExpr, Expr, IdedExpr, LiteralValue};
use cel::{Context, Env, Program};

mod cost;
mod types;
pub use cost::{BYTES_PER_STEP, COST_BUDGET, Cost, RESULT_BUDGET_BYTES};
pub use types::Kinds;

/// Longest expression accepted, in bytes (the CRD's `maxLength` is the same).
pub const MAX_LEN: usize = 4096;

/// Largest payload `json` parses and `payload` holds, in bytes: beyond it, a rule that uses
/// either sends the message to its dead-letter path. With the comprehension rules, bounds what
/// one evaluation costs (in proportion to this times the expression's length).
pub const PAYLOAD_MAX_BYTES: usize = 256 * 1024;

/// A variable an expression may use.
#[derive(Debug, Clone, Copy)]
pub struct Variable {
    pub name: &'static str,
    /// Its CEL type.
    pub kind: &'static str,
    /// Usable inside a comprehension: small, whatever the message.
    pub scalar: bool,
    pub meaning: &'static str,
}

/// Every variable an expression sees, with what it holds (docs/expressions.md's table is this list).
pub const VARIABLES: &[Variable] = &[
    Variable {
        name: "topic",
        kind: "string",
        scalar: true,
        meaning: "the MQTT topic the message was published to",
    },
    Variable {
        name: "levels",
        kind: "list(string)",
        scalar: false,
        meaning: "the topic's levels, counted from 0: `levels[1]` of `plant/7/temp` is `\"7\"`",
    },
    Variable {
        name: "qos",
        kind: "int",
        scalar: true,
        meaning: "the QoS the message was delivered with (0, 1 or 2)",
    },
    Variable {
        name: "retain",
        kind: "bool",
        scalar: true,
        meaning: "the retain flag",
    },
    Variable {
        name: "properties",
        kind: "map(string, string)",
        scalar: false,
        meaning: "MQTT 5 user properties (the last value of a repeated name); empty from MQTT 3.1.1",
    },
    Variable {
        name: "contentType",
        kind: "string",
        scalar: true,
        meaning: "the MQTT 5 content type; `\"\"` when not set",
    },
    Variable {
        name: "payload",
        kind: "bytes",
        scalar: false,
        meaning: "the payload as sent; a payload larger than 256 KiB goes to the dead-letter path of a rule that uses it",
    },
    Variable {
        name: "json",
        kind: "dyn",
        scalar: false,
        meaning: "the payload parsed as JSON (numbers without a fraction are `int`, others `double`); a message whose payload does not parse, or is larger than 256 KiB, goes to the dead-letter path of a rule that uses it",
    },
    Variable {
        name: "receivedAt",
        kind: "timestamp",
        scalar: true,
        meaning: "when the forwarder read the message",
    },
];

// `Expression::uses` is a mask of one bit per variable.
const _: () = assert!(VARIABLES.len() <= 32);

/// CEL's type names, which are identifiers too.
const TYPE_NAMES: &[&str] = &[
    "bool",
    "bytes",
    "double",
    "duration",
    "int",
    "list",
    "map",
    "null_type",
    "string",
    "timestamp",
    "type",
    "uint",
];

/// The standard environment, shared: building one costs more than most evaluations.
pub static ENV: LazyLock<Arc<Env>> = LazyLock::new(|| Arc::new(Env::stdlib()));

/// A compiled expression. Compares and prints as its source.
#[derive(Clone)]
pub struct Expression {
    source: Arc<str>,
    program: Arc<Program>,
    /// The declared variables it uses (bit i: `VARIABLES[i]`), so that a message binds only
    /// those; a mask because it is consulted for every evaluation.
    uses: u32,
    /// What of `json` it reads; `None` when it does not read `json`.
    json_reads: Option<JsonReads>,
    /// What one evaluation costs at worst.
    cost: Cost,
    /// The types it can return.
    returns: Kinds,
}

/// The parts of the payload's JSON that expressions read: an object's fields by name, down to
/// where a value is read whole. `json.device == 'a' && json.reading.temp > 5.0` reads `device`
/// and `reading.temp`; `size(json.items)` reads `items` whole; `json[k]` or `json` alone read
/// everything. What no expression reads is checked to be JSON but never built into values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonReads {
    Whole,
    /// Only these fields, if the value is an object (any other value is read whole).
    Fields(BTreeMap<String, JsonReads>),
}

impl JsonReads {
    /// Adds what `other` reads.
    pub fn merge(&mut self, other: &JsonReads) {
        match (&mut *self, other) {
            (JsonReads::Whole, _) => {}
            (_, JsonReads::Whole) => *self = JsonReads::Whole,
            (JsonReads::Fields(mine), JsonReads::Fields(theirs)) => {
                for (name, reads) in theirs {
                    match mine.get_mut(name) {
                        Some(m) => m.merge(reads),
                        None => {
                            mine.insert(name.clone(), reads.clone());
                        }
                    }
                }
            }
        }
    }

    /// What the expressions of `all` read together; `None` when none reads `json`.
    pub fn union<'e>(all: impl IntoIterator<Item = &'e Expression>) -> Option<JsonReads> {
        Self::merged(all.into_iter().filter_map(|e| e.json_reads.as_ref()))
    }

    /// All of `reads` together; `None` when there are none.
    pub fn merged<'r>(reads: impl IntoIterator<Item = &'r JsonReads>) -> Option<JsonReads> {
        reads
            .into_iter()
            .fold(None, |acc: Option<JsonReads>, reads| {
                let mut acc = acc.unwrap_or_else(|| JsonReads::Fields(BTreeMap::new()));
                acc.merge(reads);
                Some(acc)
            })
    }

    /// Adds `path` (field names from `json`), read whole at its end.
    fn read(&mut self, path: &[&str]) {
        let mut path_reads = JsonReads::Whole;
        for field in path.iter().rev() {
            path_reads = JsonReads::Fields(BTreeMap::from([((*field).to_owned(), path_reads)]));
        }
        self.merge(&path_reads);
    }
}

impl Expression {
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Whether it reads `variable`.
    pub fn uses(&self, variable: &str) -> bool {
        VARIABLES
            .iter()
            .position(|v| v.name == variable)
            .is_some_and(|i| self.uses & (1 << i) != 0)
    }

    /// The variables it reads: bit i is `VARIABLES[i]`.
    pub fn uses_mask(&self) -> u32 {
        self.uses
    }

    /// What of `json` it reads; `None` when it does not read `json`.
    pub fn json_reads(&self) -> Option<&JsonReads> {
        self.json_reads.as_ref()
    }

    /// What one evaluation costs at worst (within [`COST_BUDGET`] and [`RESULT_BUDGET_BYTES`]).
    pub fn cost(&self) -> Cost {
        self.cost
    }

    /// The types it can return, as far as its tree says (`json.a` could be any).
    pub fn returns(&self) -> Kinds {
        self.returns
    }
}

impl fmt::Debug for Expression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Expression({:?})", self.source)
    }
}

impl PartialEq for Expression {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

/// Why an expression does not compile, and where (line and column from 1, in characters).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("does not compile: {message} (at line {line}, column {column})")]
pub struct CompileError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

/// Compiles and checks `source`, for payloads of any size.
pub fn compile(source: &str) -> Result<Expression, CompileError> {
    compile_for(source, PAYLOAD_MAX_BYTES)
}

/// Compiles and checks `source`, for payloads of at most `payload_bytes` (its cost is
/// estimated for that size; expressions never read more than [`PAYLOAD_MAX_BYTES`]).
pub fn compile_for(source: &str, payload_bytes: usize) -> Result<Expression, CompileError> {
    let at_start = |message: String| CompileError {
        line: 1,
        column: 1,
        message,
    };
    if source.trim().is_empty() {
        return Err(at_start("the expression is empty".into()));
    }
    if source.len() > MAX_LEN {
        return Err(at_start(format!(
            "the expression is {} bytes long; at most {MAX_LEN} are accepted",
            source.len()
        )));
    }
    let program = ENV.compile(source).map_err(|errors| {
        let first = errors.errors.first();
        let (line, column) = first.map_or((1, 1), |e| e.pos);
        CompileError {
            line: usize::try_from(line).unwrap_or(1).max(1),
            column: usize::try_from(column).unwrap_or(1).max(1),
            message: first.map_or_else(|| "syntax error".into(), |e| e.msg.clone()),
        }
    })?;
    let mut check = Check {
        program: &program,
        source,
        uses: 0,
        json_reads: None,
        scopes: Vec::new(),
        known_functions: Context::with_env(Arc::clone(&ENV)),
    };
    check.expr(program.expression())?;
    let (uses, json_reads) = (check.uses, check.json_reads);
    let cost = within_budget(&program, payload_bytes.min(PAYLOAD_MAX_BYTES))?;
    let returns = types::result(program.expression(), &|name| {
        VARIABLES
            .iter()
            .find(|v| v.name == name)
            .map(|v| variable_kinds(v.kind))
    });
    Ok(Expression {
        source: Arc::from(source),
        program: Arc::new(program),
        uses,
        json_reads,
        cost,
        returns,
    })
}

/// Compiles `source` for a field whose value must be one of `wanted` (`what` says so in
/// words): refused when its result can never be.
/// `payload_bytes` as for [`compile_for`].
pub fn compile_returning(
    source: &str,
    wanted: Kinds,
    what: &str,
    payload_bytes: usize,
) -> Result<Expression, CompileError> {
    let e = compile_for(source, payload_bytes)?;
    if e.returns.intersects(wanted) {
        return Ok(e);
    }
    Err(CompileError {
        line: 1,
        column: 1,
        message: format!("returns {}, never {what}", e.returns),
    })
}

/// The types of a [`Variable`]'s `kind`.
fn variable_kinds(kind: &str) -> Kinds {
    match kind {
        "string" => Kinds::STRING,
        "int" => Kinds::INT,
        "bool" => Kinds::BOOL,
        "bytes" => Kinds::BYTES,
        "timestamp" => Kinds::TIMESTAMP,
        k if k.starts_with("list") => Kinds::LIST,
        k if k.starts_with("map") => Kinds::MAP,
        _ => Kinds::ANY,
    }
}

/// What `program` costs at worst ([`cost`]) on payloads of at most `payload` bytes, or why
/// that is too much.
fn within_budget(program: &Program, payload: usize) -> Result<Cost, CompileError> {
    let cost = cost::Estimator::new(payload)
        .expr(program.expression())
        .cost();
    let refuse = |message: String| CompileError {
        line: 1,
        column: 1,
        message,
    };
    if cost.steps > COST_BUDGET {
        return Err(refuse(format!(
            "one evaluation may cost an estimated {} steps at worst, over the budget of {COST_BUDGET}: \
             every variable is counted at its largest (a topic of 65,535 bytes and 32,768 levels, \
             a payload of {payload} bytes) and a comprehension multiplies its body's \
             cost by its range's size; nest fewer comprehensions or range over less, or declare \
             smaller payloads (the rule's mqtt.max_message_bytes)",
            cost.steps
        )));
    }
    if cost.result_bytes > RESULT_BUDGET_BYTES {
        return Err(refuse(format!(
            "its result may be an estimated {} bytes at worst, over the budget of \
             {RESULT_BUDGET_BYTES}: every variable is counted at its largest (a topic of 65,535 \
             bytes, a payload of {payload} bytes) and concatenations and literals add \
             their parts; copy fewer of them, or declare smaller payloads (the rule's \
             mqtt.max_message_bytes)",
            cost.result_bytes
        )));
    }
    Ok(cost)
}

/// One walk over a compiled program's tree.
struct Check<'a> {
    program: &'a Program,
    source: &'a str,
    uses: u32,
    json_reads: Option<JsonReads>,
    /// The variables of the comprehensions the walk is inside, innermost last.
    scopes: Vec<Vec<String>>,
    /// Only used to ask whether a function exists (`add_function` refuses a declared name).
    known_functions: Context<'static, 'static>,
}

impl Check<'_> {
    fn expr(&mut self, e: &IdedExpr) -> Result<(), CompileError> {
        // The walk meets the longest field path first: `json.a.b` before `json.a`.
        if !self.declared_by_scope("json")
            && let Some((root, path)) = json_field_path(e)
            && !path.is_empty()
        {
            self.ident(root, "json")?;
            self.json_reads
                .get_or_insert_with(|| JsonReads::Fields(BTreeMap::new()))
                .read(&path);
            return Ok(());
        }
        match &e.expr {
            Expr::Ident(name) => {
                if name == "json" && !self.declared_by_scope(name) {
                    self.json_reads = Some(JsonReads::Whole);
                }
                self.ident(e, name)
            }
            Expr::Call(call) => {
                self.function(e, &call.func_name)?;
                if call.func_name == "matches" {
                    self.pattern(e, call.args.last())?;
                }
                if let Some(target) = &call.target {
                    self.expr(target)?;
                }
                call.args.iter().try_for_each(|a| self.expr(a))
            }
            Expr::Comprehension(c) => {
                if !is_path(&c.iter_range) {
                    return Err(self.error(
                        &c.iter_range,
                        "a comprehension's range must be a variable, a field or element of one \
                         (json.items, x.values, levels), or a literal list: ranging over what an \
                         expression built (another comprehension's result, a concatenation) could \
                         make its cost grow exponentially with its length; for a filter then a \
                         map, use map's three-argument form, items.map(x, x.ok, x.value)"
                            .to_owned(),
                    ));
                }
                // The range and the initial value belong to the enclosing scope.
                self.expr(&c.iter_range)?;
                self.expr(&c.accu_init)?;
                let own = [Some(&c.iter_var), c.iter_var2.as_ref(), Some(&c.accu_var)];
                self.scopes
                    .push(own.into_iter().flatten().cloned().collect());
                let body = [&c.loop_cond, &c.loop_step, &c.result]
                    .into_iter()
                    .try_for_each(|part| self.expr(part));
                self.scopes.pop();
                body
            }
            Expr::List(list) => list.elements.iter().try_for_each(|x| self.expr(x)),
            Expr::Map(map) => map.entries.iter().try_for_each(|entry| match &entry.expr {
                EntryExpr::MapEntry(m) => {
                    self.expr(&m.key)?;
                    self.expr(&m.value)
                }
                EntryExpr::StructField(f) => self.expr(&f.value),
            }),
            Expr::Select(select) => self.expr(&select.operand),
            Expr::Struct(s) => Err(self.error(
                e,
                format!(
                    "message types such as {:?} are not available here",
                    s.type_name
                ),
            )),
            Expr::Literal(_) => Ok(()),
            // The crate cannot evaluate it (it would panic): refused rather than run.
            Expr::Unspecified => Err(self.error(e, "an incomplete expression".to_owned())),
        }
    }

    /// `matches`' pattern: a string literal that compiles as the evaluation will compile it,
    /// so that a typo is refused here rather than failing every message.
    fn pattern(&self, call: &IdedExpr, pattern: Option<&IdedExpr>) -> Result<(), CompileError> {
        let Some((at, Expr::Literal(LiteralValue::String(text)))) = pattern.map(|p| (p, &p.expr))
        else {
            return Err(self.error(
                call,
                "matches takes its pattern as a string literal: a pattern from the message could be any regular expression, of any cost".to_owned(),
            ));
        };
        match regex::Regex::new(text.inner()) {
            Ok(_) => Ok(()),
            Err(e) => Err(self.error(
                at,
                format!(
                    "matches' pattern {:?} is not a valid regular expression: {}",
                    text.inner(),
                    regex_error(&e)
                ),
            )),
        }
    }

    fn declared_by_scope(&self, name: &str) -> bool {
        self.scopes.iter().flatten().any(|v| v == name)
    }

    fn ident(&mut self, e: &IdedExpr, name: &str) -> Result<(), CompileError> {
        // The parser's own names (a comprehension's accumulator), and type names (`type(x) == int`).
        if name.starts_with('@') || TYPE_NAMES.contains(&name) {
            return Ok(());
        }
        if let Some(depth) = self
            .scopes
            .iter()
            .rposition(|s| s.iter().any(|v| v == name))
        {
            if depth + 1 == self.scopes.len() {
                return Ok(());
            }
            return Err(self.error(
                e,
                format!(
                    "{name:?} belongs to an enclosing comprehension: inside a comprehension only its own variables and {} may be used, so that an expression costs at most in proportion to the payload",
                    scalar_names()
                ),
            ));
        }
        let Some((index, variable)) = VARIABLES.iter().enumerate().find(|(_, v)| v.name == name)
        else {
            return Err(self.error(
                e,
                format!(
                    "undeclared reference {name:?}: the variables are {}",
                    VARIABLES
                        .iter()
                        .map(|v| v.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        if !self.scopes.is_empty() && !variable.scalar {
            return Err(self.error(
                e,
                format!(
                    "{name:?} inside a comprehension would make one message cost the square of its size: inside a comprehension only its own variables and {} may be used",
                    scalar_names()
                ),
            ));
        }
        self.uses |= 1 << index;
        Ok(())
    }

    fn function(&mut self, e: &IdedExpr, name: &str) -> Result<(), CompileError> {
        // Operators (`_+_`, `@in`, `!_`, ...) are the parser's own: always there.
        if !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
            return Ok(());
        }
        if self.known_functions.add_function(name, || true).is_err() {
            return Ok(());
        }
        Err(self.error(e, format!("undeclared function {name:?}")))
    }

    fn error(&self, e: &IdedExpr, message: String) -> CompileError {
        let offset = self
            .program
            .source_info()
            .offset_for(e.id)
            .map_or(0, |(start, _)| start as usize);
        let (line, column) = line_column(self.source, offset);
        CompileError {
            line,
            column,
            message,
        }
    }
}

/// A variable, a field or element of one (literal keys), or a literal list of literals: what a
/// comprehension may range over.
fn is_path(e: &IdedExpr) -> bool {
    match &e.expr {
        Expr::Ident(_) => true,
        Expr::Select(select) => !select.test && is_path(&select.operand),
        Expr::Call(call) if call.func_name == "_[_]" => {
            matches!(call.args.as_slice(), [operand, key] if is_path(operand) && matches!(key.expr, Expr::Literal(_)))
        }
        Expr::List(list) => list
            .elements
            .iter()
            .all(|x| matches!(x.expr, Expr::Literal(_))),
        _ => false,
    }
}

/// `json` followed by field names (`json.a.b`, `json['a']`, `has(json.a)`): the `json`
/// identifier and the names, or `None` for any other expression.
fn json_field_path(e: &IdedExpr) -> Option<(&IdedExpr, Vec<&str>)> {
    let (operand, field) = match &e.expr {
        Expr::Ident(name) if name == "json" => return Some((e, Vec::new())),
        Expr::Select(select) => (&*select.operand, select.field.as_str()),
        Expr::Call(call) if call.func_name == "_[_]" && call.target.is_none() => {
            match call.args.as_slice() {
                [operand, key] => match &key.expr {
                    Expr::Literal(LiteralValue::String(k)) => (operand, k.as_ref()),
                    _ => return None,
                },
                _ => return None,
            }
        }
        _ => return None,
    };
    let (root, mut path) = json_field_path(operand)?;
    path.push(field);
    Some((root, path))
}

/// A regex error on one line: a syntax error's own line (`error: ...`) rather than its
/// drawing of the pattern.
fn regex_error(e: &regex::Error) -> String {
    let text = e.to_string();
    text.lines()
        .find_map(|l| l.trim().strip_prefix("error: "))
        .map_or_else(|| text.replace('\n', " "), str::to_owned)
}

fn scalar_names() -> String {
    VARIABLES
        .iter()
        .filter(|v| v.scalar)
        .map(|v| v.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Line and column (from 1, in characters) of the byte `offset` of `source`.
fn line_column(source: &str, offset: usize) -> (usize, usize) {
    let (mut line, mut column) = (1, 1);
    for (at, c) in source.char_indices() {
        if at >= offset {
            break;
        }
        if c == '\n' {
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(source: &str) -> CompileError {
        match compile(source) {
            Ok(e) => panic!("{source:?} compiled: {e:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_valid_expression_compiles_and_knows_what_it_reads() {
        let e = compile("json.temp > 50.0 && levels[1] == 'north'").expect("compiles");
        assert!(e.uses("json") && e.uses("levels"));
        assert!(!e.uses("payload") && !e.uses("topic"));
        assert_eq!(
            e,
            compile("json.temp > 50.0 && levels[1] == 'north'").unwrap()
        );
    }

    fn reads(source: &str) -> Option<JsonReads> {
        compile(source).expect("compiles").json_reads
    }

    fn fields<const N: usize>(entries: [(&str, JsonReads); N]) -> JsonReads {
        JsonReads::Fields(entries.map(|(k, v)| (k.to_owned(), v)).into())
    }

    #[test]
    fn what_of_json_an_expression_reads_is_known_by_field() {
        use JsonReads::Whole;
        assert_eq!(reads("topic == 'a'"), None);
        assert_eq!(
            reads("json.type != 'heartbeat' && json['device'] == 'a'"),
            Some(fields([("device", Whole), ("type", Whole)]))
        );
        assert_eq!(
            reads("json.r.temp > 5.0 && has(json.r.unit) && json.r.temp < 9.0"),
            Some(fields([("r", fields([("temp", Whole), ("unit", Whole)]))]))
        );
        // A field read whole covers any path below it, in either order.
        assert_eq!(
            reads("json.r.temp > 5.0 && size(json.r) > 1"),
            Some(fields([("r", Whole)]))
        );
        assert_eq!(
            reads("json.items.exists(i, i.ok) && json.items[0].id == 1"),
            Some(fields([("items", Whole)]))
        );
        for everything in [
            "json",
            "json[topic] == 1",
            "json == {'a': 1}",
            "json.a + json",
        ] {
            assert_eq!(reads(everything), Some(Whole), "{everything}");
        }
        // A comprehension's own variable named json is not the payload.
        assert_eq!(reads("[1, 2].map(json, json + 1) == [2, 3]"), None);
    }

    #[test]
    fn what_expressions_read_together_is_the_union() {
        let all = ["json.a.b == 1", "json.a.c == 2 && json.d", "topic == 'x'"]
            .map(|s| compile(s).expect("compiles"));
        use JsonReads::Whole;
        assert_eq!(
            JsonReads::union(&all),
            Some(fields([
                ("a", fields([("b", Whole), ("c", Whole)])),
                ("d", Whole)
            ]))
        );
        let whole = compile("json.x || json.y").expect("compiles");
        let with_whole = [&all[0], &whole, &compile("json").expect("compiles")];
        assert_eq!(JsonReads::union(with_whole), Some(Whole));
        assert_eq!(JsonReads::union(&all[2..]), None);
    }

    #[test]
    fn a_syntax_error_names_its_position() {
        let e = refused("json.a +");
        assert_eq!((e.line, e.column), (1, 9), "{e}");
        assert!(e.message.contains("Syntax error"), "{e}");
        let e = refused("json.a &&\n  (json.b ||");
        assert_eq!(e.line, 2, "{e}");
    }

    #[test]
    fn an_undeclared_variable_is_refused_where_it_is() {
        let e = refused("json.a == 1 && jsn.b == 2");
        assert_eq!((e.line, e.column), (1, 16), "{e}");
        assert!(e.message.contains("undeclared reference \"jsn\""), "{e}");
        assert!(e.message.contains("topic, levels, qos"), "{e}");
    }

    #[test]
    fn an_undeclared_function_is_refused_and_standard_ones_pass() {
        let e = refused("lower(topic) == 'x'");
        assert!(e.message.contains("undeclared function \"lower\""), "{e}");
        for ok in [
            "size(payload) > 0 && topic.startsWith('a') && topic.endsWith('b') && topic.contains('c')",
            "topic.matches('^a/[0-9]+$') && int('7') == 7 && double(1) == 1.0 && string(qos) == '1'",
            "bytes('a') == b'a' && type(1) == int && dyn(1) == 1 && uint(1) == 1u && bool('true')",
            "receivedAt > timestamp('2020-01-01T00:00:00Z') && duration('1s') < duration('2s')",
            "receivedAt.getFullYear() > 2000 && receivedAt.getHours() >= 0",
            "has(json.a) && json.items.exists(x, x > 1) && json.items.all(x, x > 0)",
            "json.items.map(x, x * 2).size() > 0 && json.items.filter(y, y > 2).size() > 0 && json.items.exists_one(z, z == 4)",
            "1 in [1, 2] && !retain && -qos < 0 ? 'a' : 'b'",
        ] {
            assert!(compile(ok).is_ok(), "{ok:?}: {:?}", compile(ok));
        }
    }

    #[test]
    fn a_comprehension_may_not_reach_outside_its_element() {
        let e = refused("json.items.map(x, json.items)");
        assert!(e.message.contains("square"), "{e}");
        assert_eq!((e.line, e.column), (1, 19), "{e}");
        let e = refused("json.a.all(x, x.b.exists(y, y == x.c))");
        assert!(e.message.contains("enclosing comprehension"), "{e}");
        // Its own element, nested data of it, and scalars are fine.
        compile("json.a.all(x, x.b.exists(y, y == topic))").expect("compiles");
        compile("json.a.map(x, x.ok, x.v)").expect("compiles");
        compile("[1, 2].exists(n, n == qos) && json['a'][0].b.all(x, x > 0)").expect("compiles");
    }

    #[test]
    fn a_comprehension_over_what_an_expression_built_is_refused() {
        // Each stage doubles the last: 2^40 times the topic from a short expression.
        let doubling = format!("[topic]{}", ".map(t, t + t)".repeat(40));
        let e = refused(&doubling);
        assert!(e.message.contains("grow exponentially"), "{e}");
        assert_eq!(e.line, 1, "{e}");
        refused("[json.s].map(a, [a + a].map(b, b + b))");
        refused("json.a.map(x, x.v).filter(v, v > 0)");
        refused("(json.a + json.b).exists(x, x == 1)");
    }

    #[test]
    fn an_invalid_pattern_is_refused_with_the_regex_error_where_it_is() {
        let e = refused("topic.matches('^plant/(+$')");
        assert!(
            e.message
                .contains(r#"matches' pattern "^plant/(+$" is not a valid regular expression"#),
            "{e}"
        );
        assert!(
            e.message.contains("repetition operator missing expression"),
            "{e}"
        );
        assert!(!e.message.contains('\n'), "{e}");
        assert_eq!((e.line, e.column), (1, 15), "{e}");
        let e = refused("json.ok && matches(topic, '[z-a]')");
        assert!(e.message.contains("invalid character class range"), "{e}");
        refused("levels.all(l, l.matches('a{1000}{1000}{1000}'))");
    }

    #[test]
    fn what_an_expression_returns_is_known_where_its_tree_says() {
        let returns = |s: &str| compile(s).expect("compiles").returns();
        for (source, kinds) in [
            ("topic + '/x'", Kinds::STRING),
            ("json.a + '/x'", Kinds::STRING),
            ("levels[1]", Kinds::ANY),
            ("json.temp > 5.0 && retain", Kinds::BOOL),
            ("size(payload)", Kinds::INT),
            ("payload", Kinds::BYTES),
            ("qos", Kinds::INT),
            ("json.items.all(x, x > 0)", Kinds::BOOL),
            ("json.items.exists_one(x, x > 0)", Kinds::BOOL),
            ("json.items.map(x, x * 2)", Kinds::LIST),
            ("{'a': 1}", Kinds::MAP),
            ("has(json.a) ? 'x' : null", Kinds::STRING.or(Kinds::NULL)),
            ("string(qos)", Kinds::STRING),
            ("[1].map(topic, topic)", Kinds::LIST),
            ("json", Kinds::ANY),
            ("dyn(json.a)", Kinds::ANY),
        ] {
            assert_eq!(returns(source), kinds, "{source}");
        }
        let e = compile_returning("topic + '/x'", Kinds::BOOL, "a bool", PAYLOAD_MAX_BYTES)
            .unwrap_err();
        assert_eq!(e.message, "returns a string, never a bool", "{e}");
        let e = compile_returning(
            "size(topic) + 1",
            Kinds::STRING,
            "a string",
            PAYLOAD_MAX_BYTES,
        )
        .unwrap_err();
        assert!(
            e.message
                .starts_with("returns an int or a uint or a double"),
            "{e}"
        );
        for unknown in ["json.ok", "levels[0] == 'a'", "json.a ? true : json.b"] {
            compile_returning(unknown, Kinds::BOOL, "a bool", PAYLOAD_MAX_BYTES).expect(unknown);
        }
    }

    #[test]
    fn a_pattern_must_be_a_literal() {
        compile("topic.matches('^plant/[0-9]+$')").expect("compiles");
        let e = refused("topic.matches(json.re)");
        assert!(e.message.contains("string literal"), "{e}");
        refused("json.items.all(x, x.matches(x))");
    }

    #[test]
    fn empty_and_oversized_expressions_are_refused() {
        assert!(refused("  ").message.contains("empty"));
        let long = format!("topic == '{}'", "a".repeat(MAX_LEN));
        assert!(refused(&long).message.contains("at most 4096"));
    }

    #[test]
    fn positions_count_characters_not_bytes() {
        let e = refused("'é' == jsn");
        assert_eq!((e.line, e.column), (1, 8), "{e}");
    }
}

#[cfg(test)]
mod cost_tests {
    use super::*;

    /// The nine-nested `all` over ten literals of issue 21: 10^9 evaluations of its body.
    pub(crate) fn nine_nested_all() -> String {
        let mut e = "topic != ''".to_owned();
        for v in ["a", "b", "c", "d", "e", "f", "g", "h", "i"] {
            e = format!("[0,1,2,3,4,5,6,7,8,9].all({v}, {e})");
        }
        e
    }

    fn refused(source: &str) -> CompileError {
        match compile(source) {
            Ok(e) => panic!("{source:?} compiled, at an estimated {:?}", e.cost()),
            Err(e) => e,
        }
    }

    #[test]
    fn hostile_expressions_are_refused_with_the_estimate_and_the_budget() {
        let e = refused(&nine_nested_all());
        assert!(
            e.message.contains(&format!("the budget of {COST_BUDGET}")),
            "{e}"
        );
        let estimate: u64 = e
            .message
            .split("an estimated ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no estimate in {e}"));
        assert!(
            estimate >= 1_000_000_000,
            "10^9 iterations estimated at {estimate}"
        );
        // A map that copies a 65,535-byte topic into each of 131,072 elements.
        let e = refused("json.items.map(i, {'t': topic, 'v': i})");
        assert!(e.message.contains("over the budget"), "{e}");
        // `json` copied a few hundred times into one transform.
        let copies = |n| format!("[{}]", vec!["json"; n].join(", "));
        let e = refused(&copies(300));
        assert!(e.message.contains("over the budget"), "{e}");
        // Fewer copies cost little to make, but are still too large to keep.
        let e = refused(&copies(20));
        assert!(
            e.message
                .contains(&format!("over the budget of {RESULT_BUDGET_BYTES}")),
            "{e}"
        );
        assert!(e.message.contains("its result may be an estimated"), "{e}");
        // A key built from many levels of a topic that may be 65,535 bytes.
        let levels = (0..80).map(|i| format!("levels[{i}]")).collect::<Vec<_>>();
        let e = refused(&levels.join(" + "));
        assert!(e.message.contains("result may be"), "{e}");
    }

    #[test]
    fn nesting_multiplies_and_one_level_less_fits() {
        let nested = |n: usize| {
            (0..n).fold("topic != ''".to_owned(), |e, i| {
                format!("[0,1,2,3,4,5,6,7,8,9].all(v{i}, {e})")
            })
        };
        let costs: Vec<u64> = (1..=5)
            .map(|n| compile(&nested(n)).expect("compiles").cost().steps)
            .collect();
        for pair in costs.windows(2) {
            assert!(
                pair[1] >= 10 * pair[0],
                "each level multiplies by ten: {costs:?}"
            );
        }
        refused(&nested(6));
    }

    /// Whatever the docs, the examples, the tests and the bench write still compiles.
    #[test]
    fn legitimate_expressions_fit() {
        for ok in [
            "json.type != 'heartbeat'",
            "json.device",
            "'readings.' + levels[1]",
            "levels[1]",
            "{'device': json.device, 'celsius': json.temp, 'plant': levels[1]}",
            "{'device': json.device, 'value': json.value, 'site': levels[1], 'n': json.n}",
            "{'seq': json.seq, 'sent': json.sent, 'device': json.device, 'temp': json.temp}",
            "has(json.unit) ? json.unit : null",
            "json.temp > 50.0",
            "json.items.map(x, x > 0, x * 2).size() > 0",
            "{'count': size(json.items), 'n': json.n}",
            "json.a.all(x, x.b.exists(y, y == topic))",
            "[1, 2].exists(n, n == qos) && json['a'][0].b.all(x, x > 0)",
            "json.items.exists(i, i.ok) && json.items[0].id == 1",
            "json.items.map(x, x * 2).size() > 0 && json.items.filter(y, y > 2).size() > 0 && json.items.exists_one(z, z == 4)",
            "topic.matches('^plant/[0-9]+$')",
            // A pattern on every level of the longest topic: compiled once, not per call.
            "levels.all(l, l.matches('^[a-z]+$'))",
            "properties['site'] == 'north' && 'site' in properties",
            "{'data': json, 'topic': topic, 'props': properties['a']}",
        ] {
            let e = compile(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(e.cost().steps <= COST_BUDGET, "{ok}");
        }
    }

    /// Bool expressions over the variables, with comprehensions over literal lists and
    /// `json` fields.
    fn bool_expr() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just("topic != ''".to_owned()),
            Just("json.a == 'x'".to_owned()),
            Just("size(levels) > 2".to_owned()),
            Just("qos == 1".to_owned()),
            Just("topic.startsWith('a/')".to_owned()),
            Just("json.items.exists(i, i == 1)".to_owned()),
        ];
        leaf.prop_recursive(4, 24, 3, |inner| {
            prop_oneof![
                (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) && ({b})")),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) || ({b})")),
                (1usize..6, inner.clone()).prop_map(|(n, a)| {
                    let list = (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
                    format!("[{list}].all(v, {a})")
                }),
                inner.prop_map(|a| format!("!({a})")),
            ]
        })
    }

    /// The estimate without the budget (so that the properties hold beyond it).
    fn estimate(source: &str) -> Cost {
        let program = ENV.compile(source).expect("parses");
        cost::Estimator::new(PAYLOAD_MAX_BYTES)
            .expr(program.expression())
            .cost()
    }

    proptest::proptest! {
        /// Combining never costs less than either part, and a comprehension over n literals
        /// costs at least n times its body; what compiles is within both budgets, and what is
        /// refused for its cost is over one of them.
        #[test]
        fn estimates_compose(a in bool_expr(), b in bool_expr(), n in 1usize..12) {
            let (ca, cb) = (estimate(&a).steps, estimate(&b).steps);
            let both = estimate(&format!("({a}) && ({b})")).steps;
            proptest::prop_assert!(both >= ca.max(cb), "{} < {} or {}", both, ca, cb);
            let list = (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
            let looped = estimate(&format!("[{list}].all(w, {a})")).steps;
            proptest::prop_assert!(looped >= n as u64 * ca, "{} < {} x {}", looped, n, ca);
            let whole = estimate(&a);
            match compile(&a) {
                Ok(e) => {
                    proptest::prop_assert_eq!(e.cost(), whole);
                    proptest::prop_assert!(whole.steps <= COST_BUDGET && whole.result_bytes <= RESULT_BUDGET_BYTES);
                }
                Err(e) if e.message.contains("over the budget") => {
                    proptest::prop_assert!(whole.steps > COST_BUDGET || whole.result_bytes > RESULT_BUDGET_BYTES);
                }
                // Refused for its structure (a non-scalar variable inside a comprehension).
                Err(_) => {}
            }
        }
    }

    #[test]
    fn a_comprehension_over_its_enclosing_element_costs_the_outer_range_once() {
        // The inner loops together visit the elements of json.a once, not |json.a| squared.
        let flat = compile("json.a.all(x, x > 0)")
            .expect("compiles")
            .cost()
            .steps;
        let nested = compile("json.a.all(x, x.b.exists(y, y > 0))")
            .expect("compiles")
            .cost()
            .steps;
        assert!(nested < 4 * flat, "{nested} vs {flat}");
    }
}
