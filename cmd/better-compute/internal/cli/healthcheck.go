package cli

import (
	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/service"
)

func (a *app) healthcheckCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "healthcheck [URL]",
		Short: "GET a /readyz URL (default: the API's) and exit 0 when it answers 200 (for container health checks)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var url string
			if len(args) == 1 {
				url = args[0]
			} else {
				base, err := a.baseURL()
				if err != nil {
					return err
				}
				url = base + "/readyz"
			}
			if code := service.Healthcheck(url); code != 0 {
				return exitError{code: code}
			}
			return nil
		},
	}
}
