package bootstrap

// LaunchedByMPI reports whether the environment (lookup is usually
// os.LookupEnv) shows an MPI launcher: Open MPI's mpirun, or a PMI or PMIx
// launcher such as srun or hydra.
func LaunchedByMPI(lookup func(string) (string, bool)) bool {
	for _, name := range []string{"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"} {
		if _, ok := lookup(name); ok {
			return true
		}
	}
	return false
}
