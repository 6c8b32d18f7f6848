/* librdmacm's header, bound with the `rdmacm` feature (see build.rs). */
#include <rdma/rdma_cma.h>
