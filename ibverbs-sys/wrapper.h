/* The headers gpudirect-sys binds. Kept as a real file (not header_contents) so
 * the C file bindgen writes for the static inline verbs can #include it. */
#include <infiniband/verbs.h>
