/* NCCL hands plugins a printf-style logger; Rust cannot define a C
 * variadic function on stable, so the harness's is this, forwarding each
 * formatted line to Rust. */
#include <stdarg.h>
#include <stdio.h>

extern void harness_log_line(int level, unsigned long flags, const char *text);

void harness_logger(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
    char buf[8192];
    va_list ap;
    (void)file;
    (void)line;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    harness_log_line(level, flags, buf);
}
