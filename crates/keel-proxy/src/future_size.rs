//! Test-only: the size of the future a function returns, without calling it (a named local
//! holding the future would itself be kept alive, and counted, by whatever printed it).

/// A function of some arity; `Args` tells the arities apart, so that [`returned`] needs no
/// annotation.
pub(crate) trait Returns<Args> {
    type Output;
}

macro_rules! returns {
    ($($a:ident),*) => {
        impl<F: FnOnce($($a),*) -> R, R, $($a),*> Returns<($($a,)*)> for F {
            type Output = R;
        }
    };
}
returns!(A, B, C, D);
returns!(A, B, C, D, E);
returns!(A, B, C, D, E, G);
returns!(A, B, C, D, E, G, H);

/// The size of what `f` returns.
pub(crate) fn returned<F: Returns<A>, A>(_: F) -> usize {
    std::mem::size_of::<F::Output>()
}
